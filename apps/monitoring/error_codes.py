"""The monitoring app's error codes (docs/api.md, Errors)."""

from __future__ import annotations

from enum import StrEnum


class MonitoringErrorCode(StrEnum):
    FORBIDDEN = "forbidden"  # /metrics from an address that may not scrape it
