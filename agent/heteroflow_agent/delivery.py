"""A task's outcome on its way to the control plane: the final report, bounded as a whole
by `report_deadline_seconds` (6 attempts, 1 s doubling to 10 s between them, all within
the deadline; heteroflow_agent.client clips each attempt to what is left).

The report is a CAS from the status the agent saw, with the exit code and a log tail. An
outcome that did not get through is kept (up to MAX_UNDELIVERED, the oldest given up
first), with its container, and sent again by the reconciler; the container is removed
only once the server has it. Kept outcomes are also written to the agent's data
directory (heteroflow_agent.outcomes), so a restarted agent still delivers them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

from heteroflow_agent.client import AuthError, ServerClient, ServerError
from heteroflow_agent.outcomes import OutcomeStore
from heteroflow_agent.runtime import Runtime, RuntimeError_

logger = logging.getLogger("heteroflow_agent.delivery")

MAX_UNDELIVERED = 256
REPORT_ATTEMPTS = 6
REPORT_BACKOFF_SECONDS, REPORT_BACKOFF_CAP_SECONDS = 1.0, 10.0
REPORT_DEADLINE_SECONDS = 60.0  # then the outcome is kept for the reconciler
ERROR_MESSAGE_MAX = 10_000
LOG_TAIL_BYTES = 64 * 1024


def report_client(
    base_url: str,
    api_key: str,
    *,
    attempts: int = REPORT_ATTEMPTS,
    deadline: float = REPORT_DEADLINE_SECONDS,
    **settings,
) -> ServerClient:
    """The client final reports go through: its own retries and deadline, so a slow
    report never holds up the polls and beats on the agent's main client. `settings`:
    the other ServerClient settings (timeouts, user agent)."""
    return ServerClient(
        base_url,
        api_key,
        attempts=attempts,
        backoff=REPORT_BACKOFF_SECONDS,
        backoff_cap=REPORT_BACKOFF_CAP_SECONDS,
        deadline=deadline,
        **settings,
    )


@dataclass
class Outcome:
    task_id: int
    from_status: str
    status: str
    exit_code: int | None
    error_message: str = ""
    log_tail: str = ""
    # a task group member's attempt, as the server handed it out: echoed in the report so
    # that a report about an attempt that has ended never moves the member of a later one
    attempt: int | None = None


def of_attempt(task: dict, outcome: Outcome | None) -> Outcome | None:
    """The outcome stamped with the attempt of the task it is about (group members)."""
    if outcome is not None and isinstance(task.get("attempt"), int):
        outcome.attempt = task["attempt"]
    return outcome


class Delivery:
    """Reports outcomes, and keeps those that did not get through (in memory, and on disk
    under `state_dir`; None: in memory only, as in most tests). `lock` guards the kept
    outcomes; the executor shares its own, so that the reconciler reads what is being
    watched and what is kept as one."""

    def __init__(
        self,
        node_id: str,
        client: ServerClient,
        runtime: Runtime,
        *,
        state_dir: Path | None = None,
        lock: threading.Lock | None = None,
    ):
        self.node_id, self.client, self.runtime = node_id, client, runtime
        self.lock = lock or threading.Lock()
        self.undelivered: OrderedDict[int, Outcome] = OrderedDict()
        # those an earlier agent process kept are delivered by the reconciler's first pass
        self.outcome_store = OutcomeStore(state_dir, MAX_UNDELIVERED) if state_dir is not None else None
        if self.outcome_store is not None:
            for kept in self.outcome_store.load():
                self.undelivered[kept["task_id"]] = Outcome(**kept)
            if self.undelivered:
                logger.info(
                    "%d outcome(s) kept by an earlier agent process, delivered at the next reconcile: tasks %s",
                    len(self.undelivered),
                    ", ".join(str(task_id) for task_id in self.undelivered),
                )

    def deliver(self, outcome: Outcome) -> bool:
        """Report the outcome (CAS). Delivered (or moot): the container is removed. Not
        delivered: it is kept, and so is the outcome, for a later attempt."""
        body = {
            "node_id": self.node_id,
            "from_status": outcome.from_status,
            "status": outcome.status,
            "exit_code": outcome.exit_code,
            "error_message": outcome.error_message[:ERROR_MESSAGE_MAX],
            "log_tail": outcome.log_tail[-LOG_TAIL_BYTES:],
        }
        if outcome.attempt is not None:
            body["attempt"] = outcome.attempt
        try:
            response = self.client.request("PUT", f"/api/v1/tasks/{outcome.task_id}", json=body)
        except (ServerError, AuthError) as exc:
            logger.warning("task %s: outcome not delivered (%s); kept for a later attempt", outcome.task_id, exc)
            self._keep(outcome)
            return False
        if response.status_code == 409:
            # the server moved first (a retry of a report it already has, or a stop/preempt
            # decided meanwhile): its answer is the truth, nothing more to say for this state
            logger.info("task %s: the server already moved on (409)", outcome.task_id)
        elif response.status_code not in (200, 404):
            logger.error(
                "task %s: report refused: HTTP %d %s", outcome.task_id, response.status_code, response.text[:300]
            )
        with self.lock:
            was_kept = self.undelivered.pop(outcome.task_id, None) is not None
        if was_kept:
            self._persist()
        try:
            self.runtime.remove(outcome.task_id)
        except RuntimeError_ as exc:
            logger.warning("task %s: could not remove it: %s", outcome.task_id, exc)
        logger.info("task %s: %s (exit code %s) reported", outcome.task_id, outcome.status, outcome.exit_code)
        return True

    def redeliver(self) -> int:
        """Try the kept outcomes again (reconcile). Returns how many got through."""
        with self.lock:
            pending = list(self.undelivered.values())
        return sum(1 for outcome in pending if self.deliver(outcome))

    def _keep(self, outcome: Outcome) -> None:
        with self.lock:
            self.undelivered[outcome.task_id] = outcome
            self.undelivered.move_to_end(outcome.task_id)
            while len(self.undelivered) > MAX_UNDELIVERED:
                dropped, _ = self.undelivered.popitem(last=False)
                logger.error(
                    "task %s: more than %d outcomes undelivered; the oldest is given up", dropped, MAX_UNDELIVERED
                )
        self._persist()

    def _persist(self) -> None:
        """Write the kept outcomes to disk (a no-op without a state directory). The
        snapshot is taken under the store's writer lock, so the last write is the latest
        state whichever worker thread gets there first."""
        if self.outcome_store is None:
            return

        def snapshot() -> list[dict]:
            with self.lock:
                return [asdict(kept) for kept in self.undelivered.values()]

        self.outcome_store.save(snapshot)
