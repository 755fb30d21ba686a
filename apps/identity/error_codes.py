"""The identity app's error codes (docs/api.md, Errors)."""

from __future__ import annotations

from enum import StrEnum


class IdentityErrorCode(StrEnum):
    REAUTHENTICATION_REQUIRED = "reauthentication_required"
