"""Live task logs: every running task's stdout and stderr, read from its runtime and sent to
the control plane in batches every half second (POST /api/v1/nodes/{id}/logs, gzip),
on the agent's outbound-only channel like everything else (docs/agent.md#live-logs).

Per task, under `state_dir/logs/task-{id}/`:
- `state.json`: the run's id and next line number, the runtime's read cursor, and the
  spool's send offset: what to go on from after an agent restart;
- `spool.jsonl`: the lines not yet acknowledged, one `[n, at, stream, text]` a line; a
  batch is read from the send offset, and the control plane's answer (the run's next
  line it expects) moves the offset past what it has. Resending is safe: it stores each
  line once. While the control plane is away the spool grows up to `spool_bytes`; past
  that the oldest lines are dropped down to half of it, and a line says how much;
- `output.log` (and `output.log.1`): the node's own copy of the task's log, rotated at
  half of `keep_bytes` (0: none), kept KEEP_DAYS after the task ends.

Each task's output is bounded to `rate` bytes a second (a token bucket of one second):
the excess is dropped, counted in the batch (`dropped_bytes`), and the next line that
passes is preceded by a `[… N bytes dropped …]` line on the `system` stream.

One thread (`run`) reads, spools and ships; the executor tells it which tasks to follow
(`track`, when a task starts or is adopted) and when one has ended (`finish`: the last
read takes a line without its newline too, and the executor waits a little for it to be
delivered before it reports the outcome).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from heteroflow_agent.client import ServerClient, ServerError
from heteroflow_agent.runtime.base import OUTPUT_READ_BYTES, Runtime, RuntimeError_

logger = logging.getLogger("heteroflow_agent.logs")

BATCH_BYTES = 512 * 1024  # one batch, uncompressed, at most about this
TASK_BATCH_BYTES = 128 * 1024  # of which one task's lines, so that every task moves
KEEP_DAYS = 7
FINISH_WAIT_SECONDS = 5.0
# a control plane older than live logs answers the route 404: asked again this much later,
# reading nothing meanwhile (the runtime keeps the output; the cursors wait)
UNSUPPORTED_RETRY_SECONDS = 600.0


@dataclass
class TaskLog:
    task_id: int
    directory: Path
    run: str = ""
    next_n: int = 0
    cursor: dict | None = None
    send_offset: int = 0
    tokens: float = 0.0
    filled_at: float = 0.0
    dropped: int = 0  # bytes over the rate since the last marker line
    dropped_unsent: int = 0  # ...and not yet told to the control plane
    ending: bool = False  # the task has ended: the next read is the last
    ended: bool = False  # ...and it was done
    refused: bool = False
    delivered: threading.Event = field(default_factory=threading.Event)

    @property
    def spool(self) -> Path:
        return self.directory / "spool.jsonl"

    @property
    def state_file(self) -> Path:
        return self.directory / "state.json"

    def save(self) -> None:
        state = {"run": self.run, "next_n": self.next_n, "cursor": self.cursor, "send_offset": self.send_offset}
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_file)

    @classmethod
    def load(cls, task_id: int, directory: Path) -> TaskLog:
        log = cls(task_id, directory)
        try:
            state = json.loads(log.state_file.read_text())
            log.run, log.next_n = str(state["run"]), int(state["next_n"])
            log.cursor, log.send_offset = state.get("cursor"), int(state.get("send_offset", 0))
        except (OSError, ValueError, KeyError, TypeError):
            log.run = uuid.uuid4().hex[:16]  # a new run: the control plane numbers it after the last
        return log

    def unsent(self) -> int:
        try:
            return max(self.spool.stat().st_size - self.send_offset, 0)
        except OSError:
            return 0


class LogShipper:
    def __init__(
        self,
        node_id: str,
        client: ServerClient,
        runtime: Runtime,
        state_dir: Path,
        *,
        rate: int = 256 * 1024,
        spool_bytes: int = 64 * 1024 * 1024,
        keep_bytes: int = 64 * 1024 * 1024,
        ship_every: float = 0.5,
        clock=time.monotonic,
        wall=time.time,
    ):
        self.node_id, self.client, self.runtime = node_id, client, runtime
        self.root = Path(state_dir) / "logs"
        self.rate, self.spool_bytes, self.keep_bytes = rate, spool_bytes, keep_bytes
        self.ship_every, self.clock, self.wall = ship_every, clock, wall
        self.tasks: dict[int, TaskLog] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.failures = 0  # batches in a row the control plane did not take
        self.unsupported_until = None  # the control plane has no live logs: not before then

    # --- what the executor says -----------------------------------------------------------

    def track(self, task_id: int) -> None:
        """Follow a task's output (from where an earlier agent process left it)."""
        with self.lock:
            if task_id not in self.tasks:
                directory = self.root / f"task-{task_id}"
                directory.mkdir(parents=True, exist_ok=True)
                log = TaskLog.load(task_id, directory)
                log.tokens, log.filled_at = float(self.rate), self.clock()
                self.tasks[task_id] = log
        self.wake.set()

    def finish(self, task_id: int, wait: float = FINISH_WAIT_SECONDS) -> bool:
        """The task has ended: read its last output and wait up to `wait` seconds for it
        to be delivered (an unreachable control plane gets it later, from the spool).
        Whether it was delivered."""
        with self.lock:
            log = self.tasks.get(task_id)
            if log is None:
                return True
            log.ending = True
        self.wake.set()
        return log.delivered.wait(wait)

    def resume(self) -> None:
        """At start: follow again every task an earlier agent process left a spool or a
        cursor for (a task that is gone is read once more, its spool sent, then forgotten),
        and drop the node's copies of logs older than KEEP_DAYS."""
        try:
            entries = list(self.root.iterdir())
        except OSError:
            return
        cutoff = self.wall() - KEEP_DAYS * 86400
        for entry in entries:
            if not entry.name.startswith("task-") or not entry.name[5:].isdigit():
                continue
            if (entry / "state.json").exists():
                task_id = int(entry.name[5:])
                self.track(task_id)
                try:
                    state = self.runtime.state(task_id)
                except RuntimeError_:
                    continue  # cannot tell now: the executor's adoption or its end decides
                if state is None or not state.running:  # nobody will adopt it: its last read
                    self.tasks[task_id].ending = True
            else:
                try:
                    if entry.stat().st_mtime < cutoff:
                        shutil.rmtree(entry, ignore_errors=True)
                except OSError:
                    pass

    # --- the thread -----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.resume()
        while not stop.is_set():
            started = self.clock()
            try:
                self.collect()
                more = self.ship()
            except Exception:  # the loop must go on: a task's log is never worth the agent's
                logger.exception("live logs: a round failed")
                more = False
            if more:
                continue  # a backlog (after an outage): send it on at once
            pause = self.ship_every if self.failures == 0 else min(self.ship_every * 2**self.failures, 30.0)
            self.wake.wait(max(0.0, pause - (self.clock() - started)))
            self.wake.clear()

    def collect(self) -> None:
        """Read every followed task's new output into its spool (not while the control
        plane takes no live logs: the output waits in the runtime)."""
        if self.unsupported():
            return
        with self.lock:
            logs = list(self.tasks.values())
        for log in logs:
            if log.ended or log.refused:
                continue
            final = log.ending
            try:
                read = self.runtime.read_output(log.task_id, log.cursor, OUTPUT_READ_BYTES)
                while final and read.lines:  # the last read: all of it
                    self._spool(log, read)
                    read = self.runtime.read_output(log.task_id, log.cursor, OUTPUT_READ_BYTES)
            except RuntimeError_ as exc:
                logger.debug("task %s: cannot read its output now: %s", log.task_id, exc)
                continue
            self._spool(log, read)
            if final:
                log.ended = True
                log.save()

    def _spool(self, log: TaskLog, read) -> None:
        if not read.lines and read.cursor == log.cursor:
            return
        now = self.clock()
        log.tokens = min(float(self.rate), log.tokens + (now - log.filled_at) * self.rate)
        log.filled_at = now
        records, kept = [], []
        for line in read.lines:
            size = len(line.text.encode()) + 1
            if size > log.tokens:
                log.dropped += size
                log.dropped_unsent += size
                continue
            log.tokens -= size
            if log.dropped:
                records.append(self._record(log, line.at, "system", f"[… {log.dropped} bytes dropped …]"))
                log.dropped = 0
            records.append(self._record(log, line.at, line.stream, line.text))
            kept.append(line)
        if records:
            with open(log.spool, "ab") as spool:
                spool.write(b"".join(json.dumps(record).encode() + b"\n" for record in records))
            self._keep(log, records)
            self._bound_spool(log)
        log.cursor = read.cursor
        log.save()

    def _record(self, log: TaskLog, at: float, stream: str, text: str) -> list:
        record = [log.next_n, round(at, 6), stream, text]
        log.next_n += 1
        return record

    def _keep(self, log: TaskLog, records: list) -> None:
        if self.keep_bytes <= 0:
            return
        copy = log.directory / "output.log"
        text = "".join(
            f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(at))}.{int(at % 1 * 1000):03d}Z {stream} {line}\n"
            for _, at, stream, line in records
        )
        try:
            if copy.exists() and copy.stat().st_size > self.keep_bytes // 2:
                os.replace(copy, log.directory / "output.log.1")
            with open(copy, "a", encoding="utf-8", errors="replace") as handle:
                handle.write(text)
        except OSError as exc:
            logger.warning("task %s: cannot keep its log on this node: %s", log.task_id, exc)

    def _bound_spool(self, log: TaskLog) -> None:
        """Past spool_bytes unsent (the control plane away for long): keep the newest half
        of the bound, drop the rest, and say so in a line."""
        waiting = log.unsent()
        if waiting <= self.spool_bytes:
            return
        with open(log.spool, "rb") as spool:
            spool.seek(log.send_offset + waiting - self.spool_bytes // 2)
            spool.readline()  # to the start of a line
            rest = spool.read()
        lost = waiting - len(rest)
        marker = self._record(
            log, self.wall(), "system", f"[… {lost} bytes not delivered: the control plane was away …]"
        )
        tmp = log.spool.with_suffix(".tmp")
        tmp.write_bytes(rest + json.dumps(marker).encode() + b"\n")
        os.replace(tmp, log.spool)
        log.send_offset = 0
        logger.warning("task %s: %d bytes of its log dropped, the control plane being away", log.task_id, lost)

    def unsupported(self) -> bool:
        if self.unsupported_until is None:
            return False
        if self.clock() < self.unsupported_until:
            return True
        self.unsupported_until = None  # time to ask again
        return False

    def ship(self) -> bool:
        """Send one batch of what waits. Whether more waits after it (sent at once)."""
        if self.unsupported():
            self._forget_delivered_ended()
            return False
        with self.lock:
            logs = [log for log in self.tasks.values() if not log.refused]
        items, ends, total = [], {}, 0
        for log in logs:
            lines, end = self._read_spool(log, min(TASK_BATCH_BYTES, BATCH_BYTES - total))
            if lines or log.dropped_unsent:
                items.append(
                    {"task_id": log.task_id, "run": log.run, "lines": lines, "dropped_bytes": log.dropped_unsent}
                )
                ends[log.task_id] = (end, lines[-1][0] if lines else None, log.dropped_unsent)
                total += sum(len(line[3]) + 24 for line in lines)
            if total >= BATCH_BYTES:
                break
        if not items:
            self._forget_delivered(logs)
            return False
        body = gzip.compress(json.dumps({"tasks": items}).encode(), compresslevel=5)
        try:
            response = self.client.request(
                "POST",
                f"/api/v1/nodes/{self.node_id}/logs",
                data=body,
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
                attempts=1,
            )
        except ServerError as exc:
            self.failures += 1
            if self.failures in (1, 10) or self.failures % 100 == 0:
                logger.warning("live logs: the control plane did not take a batch (%s); kept on disk", exc)
            return False
        if response.status_code in (404, 405):
            if self.unsupported_until is None:
                logger.warning(
                    "live logs: the control plane at %s takes none (HTTP %s: a server older than this agent?); "
                    "the final report's tail still goes; asking again in %.0f s",
                    self.client.base_url,
                    response.status_code,
                    UNSUPPORTED_RETRY_SECONDS,
                )
            self.unsupported_until = self.clock() + UNSUPPORTED_RETRY_SECONDS
            self._forget_delivered_ended()
            return False
        if response.status_code != 200:
            self.failures += 1
            logger.warning(
                "live logs: the control plane refused a batch: %s %s", response.status_code, response.text[:300]
            )
            return False
        self.failures = 0
        answer = response.json()
        refused = set(answer.get("refused") or [])
        expected = {int(key): value for key, value in (answer.get("tasks") or {}).items()}
        for log in logs:
            if log.task_id in refused:
                logger.info("task %s: the control plane takes no log of it (not this node's): forgotten", log.task_id)
                log.refused = True
                continue
            if log.task_id in ends and log.task_id in expected:
                end, last_n, dropped = ends[log.task_id]
                log.dropped_unsent -= dropped
                if last_n is None or expected[log.task_id] > last_n:
                    self._acknowledge(log, end)
        self._forget_delivered(logs)
        return total >= BATCH_BYTES or any(log.unsent() for log in logs if not log.refused)

    def _read_spool(self, log: TaskLog, budget: int) -> tuple[list, int]:
        if budget <= 0 or log.unsent() == 0:
            return [], log.send_offset
        lines, end = [], log.send_offset
        try:
            with open(log.spool, "rb") as spool:
                spool.seek(log.send_offset)
                while budget > 0:
                    raw = spool.readline()
                    if not raw.endswith(b"\n"):
                        break
                    try:
                        lines.append(json.loads(raw))
                    except ValueError:  # a line cut by a crash: skipped
                        pass
                    end += len(raw)
                    budget -= len(raw)
        except OSError:
            return [], log.send_offset
        return lines, end

    def _acknowledge(self, log: TaskLog, end: int) -> None:
        log.send_offset = end
        if log.unsent() == 0:
            try:
                with open(log.spool, "r+b") as spool:
                    spool.truncate(0)
            except OSError:
                pass
            log.send_offset = 0
        log.save()

    def _forget_delivered_ended(self) -> None:
        """Without live logs, an ended task is not waited for: its outcome goes at once."""
        with self.lock:
            ending = [log for log in self.tasks.values() if log.ending]
        for log in ending:
            log.delivered.set()
            with self.lock:
                self.tasks.pop(log.task_id, None)

    def _forget_delivered(self, logs: list[TaskLog]) -> None:
        for log in logs:
            if (log.ended and log.unsent() == 0 and not log.dropped_unsent) or log.refused:
                log.delivered.set()
                with self.lock:
                    self.tasks.pop(log.task_id, None)
                for name in ("state.json", "spool.jsonl"):
                    try:
                        (log.directory / name).unlink()
                    except OSError:
                        pass
