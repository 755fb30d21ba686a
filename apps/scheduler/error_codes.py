"""The scheduler's error codes (docs/api.md, Errors). A task's `schedule_reason` codes
are not errors: they are the placement core's (apps.scheduler.core)."""

from __future__ import annotations

from enum import StrEnum


class SchedulerErrorCode(StrEnum):
    PLUGIN_LOCKED = "plugin_locked"
