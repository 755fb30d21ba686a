"""Download progress, throttled: the control plane hears at most one report per
`interval` seconds (and always the first and the last), each with the bytes done and
to do, the speed since the previous report and the time left at that speed."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    bytes_done: int
    bytes_total: int
    bytes_per_second: float
    eta_seconds: float | None  # None: not known yet (no speed measured)

    def as_payload(self) -> dict:
        return {
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
            "bytes_per_second": round(self.bytes_per_second, 1),
            "eta_seconds": None if self.eta_seconds is None else round(self.eta_seconds, 1),
        }


class ProgressThrottle:
    """Call `advance(n)` as bytes arrive; `send` is called with a Progress at most once
    per `interval` seconds (the first call sends at once: the page shows the download as
    soon as it starts). `finish()` sends the final figures whatever the time."""

    def __init__(
        self,
        total: int,
        send: Callable[[Progress], None],
        *,
        done: int = 0,
        interval: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.done, self.send, self.interval, self.clock = total, done, send, interval, clock
        self.last_at: float | None = None
        self.last_done = done
        self.speed = 0.0

    def advance(self, count: int) -> None:
        self.done += count
        now = self.clock()
        if self.last_at is None or now - self.last_at >= self.interval:
            self._send(now)

    def finish(self) -> None:
        self._send(self.clock())

    def _send(self, now: float) -> None:
        if self.last_at is not None and now > self.last_at:
            self.speed = (self.done - self.last_done) / (now - self.last_at)
        left = max(self.total - self.done, 0)
        eta = left / self.speed if self.speed > 0 else (0.0 if left == 0 else None)
        self.last_at, self.last_done = now, self.done
        self.send(Progress(self.done, self.total, self.speed, eta))
