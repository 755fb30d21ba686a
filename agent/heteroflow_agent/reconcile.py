"""The reconciler: every 60 s (and at start) it re-reports the outcomes the executor
kept, adopts the tasks the runtime holds that no watcher follows (left by an earlier
agent process), reports a task the server has running here with nothing for it as lost,
and removes zombies; after each heartbeat that got through, a light pass removes zombies
only. It works through the executor's client, runtime and bookkeeping, never past them.

A task whose outcome is kept (in memory, or loaded from the data directory by a new
agent process: heteroflow_agent.outcomes) is neither adopted nor reported lost: the
server still has it running only because it has not got the outcome yet, and the next
pass tries that again.
"""

from __future__ import annotations

import logging
import time

from heteroflow_agent.client import ServerError
from heteroflow_agent.delivery import Outcome, of_attempt
from heteroflow_agent.executor import STOP_GRACE_SECONDS, Executor
from heteroflow_agent.protocol.task_status import CONFIRMS, RUNNING, TERMINAL, ended
from heteroflow_agent.runtime import RuntimeError_

logger = logging.getLogger("heteroflow_agent.reconcile")

ZOMBIE_MIN_AGE_SECONDS = 60.0


class Reconciler:
    """Every 60 s: re-report kept outcomes, adopt tasks this agent is not watching (left
    by an earlier agent process), and remove zombies. A task is a zombie only when the
    server says it is terminal, deleted (404) or assigned elsewhere, and only once its
    container is older than a minute; anything else, a lookup error included, is left
    alone."""

    def __init__(self, executor: Executor, clock=time.time):
        self.executor, self.clock = executor, clock

    def run_once(self) -> dict[str, list[int]]:
        """The full pass (every 60 s): kept outcomes, then every task nobody watches."""
        executor = self.executor
        done = {"redelivered": [], "adopted": [], "reported": [], "removed": [], "lost": []}
        before = set(executor.undelivered)
        executor.redeliver()
        done["redelivered"] = sorted(before - set(executor.undelivered))
        self._unwatched(done, adopt=True)
        self._lost(done)
        return done

    def _lost(self, done: dict[str, list[int]]) -> None:
        """Tasks the server has running on this node that this node has nothing for: the
        fact is reported and the server decides. When this node's own tasks cannot be
        listed, nothing is said."""
        executor = self.executor
        try:
            response = executor.client.request(
                "GET", "/api/v1/tasks", params={"node_id": executor.node_id, "status": RUNNING, "limit": 100}
            )
        except ServerError:
            return
        if response.status_code != 200:
            return
        try:
            held = executor.runtime.tasks()
        except Exception as exc:
            logger.warning("reconcile: cannot list the runtime's tasks: %s", exc)
            return
        for task in response.json().get("results", []):
            task_id = task["id"]
            with executor.lock:
                if task_id in executor.active or task_id in executor.undelivered:
                    continue
            if task_id in held:
                continue
            executor.report_lost(task_id, "no container or process for it on this node")
            done["lost"].append(task_id)

    def sweep_zombies(self) -> list[int]:
        """The light pass (after each heartbeat that got through): zombies only."""
        done = {"redelivered": [], "adopted": [], "reported": [], "removed": [], "lost": []}
        self._unwatched(done, adopt=False)
        return done["removed"]

    def _unwatched(self, done: dict[str, list[int]], *, adopt: bool) -> None:
        executor = self.executor
        try:
            held = executor.runtime.tasks()
        except Exception as exc:
            logger.warning("reconcile: cannot list the runtime's tasks: %s", exc)
            return
        for task_id, state in sorted(held.items()):
            with executor.lock:
                if task_id in executor.active or task_id in executor.undelivered:
                    continue
            task = self._lookup(task_id)
            if task is None:
                continue  # cannot tell: leave it
            if task == 404 or task.get("status") in TERMINAL:
                if self.clock() - (state.started_at or self.clock()) >= ZOMBIE_MIN_AGE_SECONDS:
                    try:
                        executor.runtime.stop(task_id, STOP_GRACE_SECONDS)
                        executor.runtime.remove(task_id)
                        done["removed"].append(task_id)
                    except RuntimeError_ as exc:
                        logger.warning("zombie task %s not removed: %s", task_id, exc)
                continue
            if not adopt:
                continue
            if task.get("status") == RUNNING:
                if state.running:
                    executor.watch_adopted(task, state.started_at)
                    done["adopted"].append(task_id)
                else:  # it ended while no agent was watching: report it now
                    code = state.exit_code
                    outcome = Outcome(
                        task_id,
                        RUNNING,
                        ended(code),
                        code,
                        "" if code == 0 else f"exited with code {code} while the agent was away",
                        executor.runtime.logs_tail(task_id),
                    )
                    executor.deliver(of_attempt(task, outcome))
                    done["reported"].append(task_id)
            elif task.get("status") in CONFIRMS:
                executor.watch_adopted(task, state.started_at)  # the watch stops it and confirms
                done["adopted"].append(task_id)

    def _lookup(self, task_id: int):
        try:
            response = self.executor.client.request(
                "GET", f"/api/v1/tasks/{task_id}", params={"node_id": self.executor.node_id}
            )
        except ServerError:
            return None
        if response.status_code == 404:
            return 404  # deleted, or assigned to another node
        if response.status_code != 200:
            return None
        return response.json()
