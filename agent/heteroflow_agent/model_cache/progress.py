"""Download progress, throttled: the control plane hears at most one report per
`interval` seconds (and always the first and the last), each with the bytes done and
to do, the speed since the previous report and the time left at that speed.

The reports leave from a thread of their own (QueuedReports), so a slow or unreachable
control plane never slows a download: while one report is on its way, a newer `fetching`
report of the same replica replaces the one still waiting (only the latest figures
matter); `ready` and `failed` are never dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("heteroflow_agent.model_cache")

FETCHING = "fetching"
MAX_QUEUED = 256


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


class QueuedReports:
    """A report function (task id, state, fields) that returns at once; a daemon thread
    calls `send` with each report in order."""

    def __init__(self, send: Callable[[int, str, dict], None]):
        self.send = send
        self.changed = threading.Condition()
        self.queue: list[tuple[int, str, dict]] = []
        self.sending = False
        threading.Thread(target=self._run, name="model-reports", daemon=True).start()

    def __call__(self, task_id: int, state: str, fields: dict) -> None:
        with self.changed:
            if state == FETCHING:
                for index, (queued_task, queued_state, _) in enumerate(self.queue):
                    if (queued_task, queued_state) == (task_id, FETCHING):
                        self.queue[index] = (task_id, state, fields)  # newer figures, same place
                        return
                if len(self.queue) >= MAX_QUEUED:
                    return  # a control plane this far behind gets the next figures, or the end
            self.queue.append((task_id, state, fields))
            self.changed.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued report has been sent (or failed to be); False on timeout."""
        with self.changed:
            return self.changed.wait_for(lambda: not self.queue and not self.sending, timeout)

    def _run(self) -> None:
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.queue)
                report = self.queue.pop(0)
                self.sending = True
            try:
                self.send(*report)
            except Exception:  # a report is best effort: never the end of the thread
                logger.exception("task %s: model %s report failed", report[0], report[1])
            finally:
                with self.changed:
                    self.sending = False
                    self.changed.notify_all()
