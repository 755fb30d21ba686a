"""What the identity tests share."""

from __future__ import annotations

from django_tenants.utils import schema_context

from apps.confidential.models import AuditEvent


def tenant_log(tenant, action: str, target: str) -> AuditEvent:
    """The one event `action` on `target` in `tenant`'s own audit log."""
    with schema_context(tenant.schema_name):
        return AuditEvent.objects.get(action=action, target=target)
