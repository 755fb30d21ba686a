"""The alerts app's error codes (docs/api.md, Errors)."""

from __future__ import annotations

from enum import StrEnum


class AlertErrorCode(StrEnum):
    ALERT_ENDED = "alert_ended"
    CHANNEL_EXISTS = "channel_exists"
    NOT_A_WEBHOOK = "not_a_webhook"
    TEST_PENDING = "test_pending"
