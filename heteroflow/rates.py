"""Rates as settings spell them ('6000/min'): parsed once, when the settings load, so a
typo stops the process at start rather than at the first request."""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured

PERIODS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600}
RATE = re.compile(r"^(\d+)/(\d*)([a-z]+)$")


@dataclass(frozen=True)
class Rate:
    """`count` requests per `period` seconds; count 0: no limit."""

    count: int
    period: int

    @property
    def unlimited(self) -> bool:
        return self.count == 0


def parse_rate(name: str, text: str) -> Rate:
    """'6000/min', '100/s', '50/10s', '20000/h'; 'off' (or '0'): no limit."""
    spelled = (text or "").replace(" ", "").lower()
    if spelled in ("0", "off", "none"):
        return Rate(0, 1)
    match = RATE.match(spelled)
    if not match or match[3] not in PERIODS or int(match[1]) == 0 or (match[2] and int(match[2]) == 0):
        raise ImproperlyConfigured(
            f"{name}={text!r} is not a rate like 6000/min, 100/s, 50/10s or 20000/h (or 'off' for no limit)"
        )
    return Rate(int(match[1]), int(match[2] or 1) * PERIODS[match[3]])
