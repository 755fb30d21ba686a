"""The tasks app's error codes (docs/api.md, Errors)."""

from __future__ import annotations

from enum import StrEnum


class TaskErrorCode(StrEnum):
    QUOTA_EXCEEDED = "quota_exceeded"
    SLICE_NOT_CONFIRMED = "slice_not_confirmed"
    ATTEMPT_ENDED = "attempt_ended"
