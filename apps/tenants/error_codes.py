"""The tenants app's error codes (docs/api.md, Errors)."""

from __future__ import annotations

from enum import StrEnum


class TenantErrorCode(StrEnum):
    TENANT_EXISTS = "tenant_exists"
    TENANT_HAS_ACTIVE_TASKS = "tenant_has_active_tasks"
    TENANT_HAS_DEDICATED_NODES = "tenant_has_dedicated_nodes"
    ALREADY_MEMBER = "already_member"
    LAST_ADMIN = "last_admin"
    GROUP_EXISTS = "group_exists"
