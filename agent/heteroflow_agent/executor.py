"""The executor: takes the tasks the scheduler sent to this node and runs them to the end.

Every poll (5 s) it asks for the node's scheduled tasks and claims each with a
compare-and-set `scheduled → running` (a 409 means another claim won: leave it). A
worker then routes an inference task to its engine (heteroflow_agent.engines), turns
the task into what the runtime launches (heteroflow_agent.task_spec: volumes checked
against the allow- and deny-lists, env entries without a value dropped, the GPU
visibility variables set by the agent alone), makes the image present, starts
`task-{id}` and watches it: the timeout watchdog (exit code 124), the server's stop
intent (polled every 5 s; three 404s in a row mean the task was deleted), health probes
for inference. The outcome goes to heteroflow_agent.delivery: reported as a CAS within
the report deadline, else kept (with its container, on disk too) for the reconciler.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import threading
import time
import urllib.request
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from heteroflow_agent import checkpoint, delivery, interactive, task_spec
from heteroflow_agent.client import ServerClient, ServerError
from heteroflow_agent.delivery import Delivery, Outcome, of_attempt
from heteroflow_agent.engines import launch
from heteroflow_agent.engines.router import AUTO, EngineRouter, Route
from heteroflow_agent.heartbeat import TaskReport
from heteroflow_agent.model_cache.ensure import ModelEnsurer
from heteroflow_agent.model_cache.store import EnsureCancelled, EnsureError
from heteroflow_agent.outcomes import OutcomeStore
from heteroflow_agent.protocol.task_status import CONFIRMS, FAILED, RUNNING, SCHEDULED, TERMINAL, ended
from heteroflow_agent.runtime import Runtime, RuntimeError_, TaskSpec
from heteroflow_agent.slicing import mps as mps_slices
from heteroflow_agent.task_spec import DEFAULT_VOLUME_ALLOW, DEFAULT_VOLUME_DENY, confirmed_slice, memory_only

logger = logging.getLogger("heteroflow_agent.executor")

POLL_LIMIT = 20
STOP_POLL_SECONDS = 5.0
GONE_AFTER_404S = 3
TIMEOUT_EXIT_CODE = 124
MAX_WITHHELD = 256
STOP_GRACE_SECONDS = 10.0
SETTLE_READS = 6  # 3 s for an ended task's exit code to appear


def time_limit(task: dict) -> tuple[float, str]:
    """How long a task may run and, when it runs past it, what its failure says: its
    timeout, or the duration it declared (max_duration_seconds, never more than the
    timeout) when that is shorter."""
    timeout = task.get("timeout_seconds") or 7200
    declared = task.get("max_duration_seconds")
    if declared and declared < timeout:
        return declared, f"ran past its declared duration of {declared} s (max_duration_seconds)"
    return timeout, f"timed out after {timeout} s"


def worker_count(cpus: int | None = None) -> int:
    return min(max(cpus or os.cpu_count() or 2, 2), 16)


class Executor:
    def __init__(
        self,
        node_id: str,
        client: ServerClient,
        runtime: Runtime,
        *,
        vendor: str = "",
        report_client: ServerClient | None = None,
        workers: int | None = None,
        volume_allow: tuple[str, ...] = DEFAULT_VOLUME_ALLOW,
        volume_deny: tuple[str, ...] = DEFAULT_VOLUME_DENY,
        watch_interval: float = 1.0,
        stop_poll_seconds: float = STOP_POLL_SECONDS,
        shm_free_mb=None,
        router: EngineRouter | None = None,
        engine_python: str | None = None,
        state_dir: Path | None = None,
    ):
        self.node_id, self.client, self.runtime = node_id, client, runtime
        self.vendor = vendor
        reports = report_client or delivery.report_client(client.base_url, client.session.headers["X-API-Key"])
        self.pool = ThreadPoolExecutor(max_workers=workers or worker_count(), thread_name_prefix="task")
        self.volume_allow, self.volume_deny = volume_allow, volume_deny
        self.watch_interval, self.stop_poll_seconds = watch_interval, stop_poll_seconds
        self.shm_free_mb = shm_free_mb or host_shm_free_mb
        self.active: dict[int, threading.Event] = {}  # task id -> "stop watching" (agent shutdown)
        self.health: dict[int, dict] = {}
        self.serving: dict[int, int] = {}  # inference task id -> host port (its /v1/models is read)
        self.router = router  # chooses an inference task's engine image when it asks for one
        self.engine_python = engine_python or sys.executable  # runs engines under the process runtime
        self.lock = threading.Lock()
        self.delivery = Delivery(node_id, reports, runtime, state_dir=state_dir, lock=self.lock)
        self.closing = threading.Event()
        self.wake = threading.Event()  # set by the heartbeat when tasks wait for this node
        self.sweep = threading.Event()  # set after each heartbeat that got through: look for zombies
        self.withheld: set[int] = set()  # memory-only tasks left alone for want of a confirmed slice (logged once)
        self.logs = None  # a logs.LogShipper that follows each running task's output, when set
        self.models: ModelEnsurer | None = None  # makes a replica's model present before its engine starts
        self.mps_pipe = mps_slices.pipe_directory()
        self.mps_log = mps_slices.log_directory()

    # --- the poll -----------------------------------------------------------------------

    def poll(self) -> list[int]:
        """Fetch the node's scheduled tasks and claim them. Returns the ids claimed."""
        try:
            response = self.client.request(
                "GET", "/api/v1/tasks", params={"node_id": self.node_id, "status": SCHEDULED, "limit": POLL_LIMIT}
            )
        except ServerError as exc:
            logger.warning("could not fetch tasks: %s", exc)
            return []
        if response.status_code != 200:
            logger.error("fetching tasks refused: HTTP %d %s", response.status_code, response.text[:300])
            return []
        claimed = []
        for task in response.json().get("results", []):
            if memory_only(task) and confirmed_slice(task) is None:
                # no limit, no start: a share of a card runs only inside its confirmed slice
                if task["id"] not in self.withheld:
                    if len(self.withheld) >= MAX_WITHHELD:
                        self.withheld.clear()  # tasks that left the list meanwhile: at worst logged again
                    self.withheld.add(task["id"])
                    state = (task.get("slice") or {}).get("state") if isinstance(task.get("slice"), dict) else None
                    logger.info(
                        "task %s: memory-only and its slice is %s: not started until the slice is confirmed",
                        task["id"],
                        state or "missing",
                    )
                continue
            self.withheld.discard(task["id"])
            with self.lock:
                if task["id"] in self.active or self.closing.is_set():
                    continue
                # reserved before the claim, so the reconciler never takes a task just
                # claimed (running on the server, nothing here yet) for a lost one
                stop = self.active[task["id"]] = threading.Event()
            if self._claim(task):
                claimed.append(task["id"])
                self.pool.submit(self._work, task["id"], lambda task=task, stop=stop: self.run(task, stop))
            else:
                with self.lock:
                    self.active.pop(task["id"], None)
        return claimed

    def _claim(self, task: dict) -> bool:
        try:
            response = self.client.request(
                "PUT",
                f"/api/v1/tasks/{task['id']}",
                json={"node_id": self.node_id, "from_status": SCHEDULED, "status": RUNNING},
            )
        except ServerError as exc:
            logger.warning("could not claim task %s: %s", task["id"], exc)
            return self._claim_landed(task["id"])
        if response.status_code == 200:
            return True
        if response.status_code == 409 or response.status_code >= 500:
            # another claim won or it was cancelled meanwhile (409), unless an earlier try
            # of this claim landed: the client's retry after a lost answer meets its own
            # claim, and a server can fail after its commit (5xx)
            return self._claim_landed(task["id"])
        logger.error("claiming task %s refused: HTTP %d %s", task["id"], response.status_code, response.text[:300])
        return False

    def _claim_landed(self, task_id: int) -> bool:
        """Whether the server has the task running on this node: only this node's agent
        claims this node's tasks, so then the claim whose answer was lost is this one's.
        When the server cannot say, no: the reconciler reports it lost if it was."""
        try:
            response = self.client.request("GET", f"/api/v1/tasks/{task_id}", params={"node_id": self.node_id})
        except ServerError:
            return False
        landed = response.status_code == 200 and response.json().get("status") == RUNNING
        if landed:
            logger.info("task %s: the claim whose answer was lost had landed; running it", task_id)
        return landed

    def watch_adopted(self, task: dict, started_at: float | None) -> None:
        """Watch a task that is already running (adopted), then report it. Its timeout
        counts from when it really started."""
        began = time.monotonic() - max(0.0, time.time() - started_at) if started_at else time.monotonic()
        stop = threading.Event()
        with self.lock:
            self.active[task["id"]] = stop
        if self.logs is not None:
            self.logs.track(task["id"])
        if self.models is not None:
            self.models.hold(task["id"], launch.serving_of(task))
        self.pool.submit(self._work, task["id"], lambda: self.watch(task, stop, began))

    # --- one task -----------------------------------------------------------------------

    def _work(self, task_id: int, to_the_end) -> None:
        """A worker: run or watch the task to its end, then deliver the outcome."""
        try:
            outcome = to_the_end()
            if self.logs is not None and not self.closing.is_set():
                # its last lines before its outcome, so that a follower sees them before the
                # end (not waited for long: an unreachable control plane gets them later)
                self.logs.finish(task_id, wait=5.0 if outcome is not None else 0.0)
            if outcome is not None:
                self.deliver(outcome)
        except Exception:
            logger.exception("task %s: the worker failed", task_id)
        finally:
            with self.lock:
                self.active.pop(task_id, None)
                self.health.pop(task_id, None)
                self.serving.pop(task_id, None)
            if self.models is not None:
                self.models.release(task_id)  # its model may be evicted now (least recently used first)

    def spec_for(self, task: dict) -> TaskSpec:
        """What the runtime launches for the task, by this node's rules; a checkpoint
        resume decided on the way goes into the task's history."""
        spec, decision = task_spec.build(task, self.node_rules())
        if decision:
            logger.info("task %s: %s", task["id"], decision)
            resume = spec.env.get(checkpoint.RESUME_VARIABLE)
            self.record_event(task["id"], "checkpoint_resume", decision, {"resume_from": resume})
        return spec

    def node_rules(self) -> task_spec.NodeRules:
        """This node's rules for a task's spec, read when a task starts."""
        return task_spec.NodeRules(
            vendor=self.vendor,
            runtime_kind=getattr(self.runtime, "kind", ""),
            volume_allow=self.volume_allow,
            volume_deny=self.volume_deny,
            mps_pipe=self.mps_pipe,
            mps_log=self.mps_log,
            shm_free_mb=self.shm_free_mb,
        )

    def run(self, task: dict, stop: threading.Event) -> Outcome | None:
        """Start the task and watch it to its end. The outcome to report, or None when
        there is nothing to report (the task was deleted, or the agent is stopping)."""
        return of_attempt(task, self._run(task, stop))

    def _run(self, task: dict, stop: threading.Event) -> Outcome | None:
        task_id = task["id"]
        if task.get("missing_secrets"):
            # the tenant deleted a secret the task needs: running without it would be wrong
            missing = ", ".join(task["missing_secrets"])
            return Outcome(task_id, RUNNING, FAILED, None, f"could not start: the tenant has no secret named {missing}")
        routed = self.route(task)
        if routed is not None and routed.refused:
            return Outcome(task_id, RUNNING, FAILED, None, f"could not start: {routed.reason}"[:2000])
        if routed is not None:
            logger.info("task %s: engine %s (%s)", task_id, routed.image, routed.reason)
            fetch = FetchWatch(stop, lambda: self._server_status(task_id), self.stop_poll_seconds)
            try:
                with fetch:
                    task = self.launched(self.with_model(task, fetch), routed)
            except EnsureCancelled:
                return fetch.abandoned(task_id)
            except (launch.LaunchError, EnsureError) as exc:
                return Outcome(task_id, RUNNING, FAILED, None, f"could not start: {exc}"[:2000])
        try:
            if task.get("kind") == "interactive":
                task = interactive.with_app(
                    task, runtime_kind=getattr(self.runtime, "kind", ""), python=self.engine_python
                )
            spec = self.spec_for(task)
            if self.runtime.kind == "docker":
                self.runtime.ensure_image(spec.image, task.get("registry_auth"))
            self.runtime.start(spec)
        except RuntimeError_ as exc:
            return Outcome(task_id, RUNNING, FAILED, None, f"could not start: {exc}")
        logger.info("task %s started (%s)", task_id, self.runtime.kind)
        if self.logs is not None:
            self.logs.track(task_id)
        return self._watch(task, stop, time.monotonic())

    def watch(self, task: dict, stop: threading.Event, started: float) -> Outcome | None:
        return of_attempt(task, self._watch(task, stop, started))

    def _watch(self, task: dict, stop: threading.Event, started: float) -> Outcome | None:
        task_id = task["id"]
        limit, limit_words = time_limit(task)
        deadline = started + limit
        next_poll = time.monotonic() + self.stop_poll_seconds
        gone = 0
        unsettled = 0
        probe = health_probe(task)
        if task.get("kind") == "inference" and task.get("host_port"):
            with self.lock:
                self.serving[task_id] = int(task["host_port"])
        while not stop.is_set():
            try:
                state = self.runtime.state(task_id)
            except RuntimeError_ as exc:  # the engine did not answer: cannot tell, keep watching
                logger.warning("task %s: cannot read its state: %s", task_id, exc)
                stop.wait(self.watch_interval * 5)
                continue
            if state is None:  # a fact for the server to judge, not a failure to report
                self.report_lost(task_id, "its container disappeared while the agent watched it")
                return None
            if not state.running and state.exit_code is None and unsettled < SETTLE_READS:
                # just ended: an engine may not have recorded the exit code yet (Podman
                # shows "stopped" before "exited")
                unsettled += 1
                stop.wait(0.5)
                continue
            if not state.running:
                code = state.exit_code
                message = (
                    ""
                    if code == 0
                    else (f"exited with code {code}" if code is not None else "ended, exit code unknown")
                )
                return Outcome(task_id, RUNNING, ended(code), code, message, self.runtime.logs_tail(task_id))
            now = time.monotonic()
            if now >= deadline:
                self._stop(task_id)
                return Outcome(
                    task_id, RUNNING, FAILED, TIMEOUT_EXIT_CODE, limit_words, self.runtime.logs_tail(task_id)
                )
            if now >= next_poll:
                next_poll = now + self.stop_poll_seconds
                intent = self._server_status(task_id)
                if intent == 404:
                    gone += 1
                    if gone >= GONE_AFTER_404S:
                        self._discard(task_id, "gone from the server (deleted, or moved to another node)")
                        return None
                else:
                    gone = 0
                if intent in TERMINAL:
                    # the server ended it (a lost node's task failed, say): ours is a zombie
                    self._discard(task_id, f"{intent} on the server")
                    return None
                if intent in CONFIRMS:
                    self._stop(task_id)
                    try:
                        final = self.runtime.state(task_id)
                    except RuntimeError_:
                        final = None
                    code = final.exit_code if final else None
                    return Outcome(task_id, intent, CONFIRMS[intent], code, "", self.runtime.logs_tail(task_id))
                if probe:
                    self.health[task_id] = {"task_id": task_id, "healthy": probe_ok(probe)}
            stop.wait(self.watch_interval)
        return None  # the agent is stopping: the task keeps running, the next agent adopts it

    def _discard(self, task_id: int, why: str) -> None:
        """Stop and remove a task the server no longer wants here; nothing to report."""
        logger.info("task %s is %s: stopping and removing it", task_id, why)
        self._stop(task_id)
        try:
            self.runtime.remove(task_id)
        except RuntimeError_ as exc:
            logger.warning("task %s: could not remove it: %s", task_id, exc)

    def record_event(self, task_id: int, kind: str, message: str, details: dict | None = None) -> None:
        """Tell the server something worth keeping in the task's history. Best effort: an
        event that does not get through is logged here and dropped."""
        try:
            response = self.client.request(
                "POST",
                f"/api/v1/tasks/{task_id}/events",
                json={"node_id": self.node_id, "kind": kind, "message": message[:2000], "details": details or {}},
                attempts=1,
            )
            if response.status_code not in (200, 201):
                logger.info("task %s: event %s not recorded (HTTP %d)", task_id, kind, response.status_code)
        except ServerError as exc:
            logger.info("task %s: event %s not recorded (%s)", task_id, kind, exc)

    def _stop(self, task_id: int) -> None:
        try:
            self.runtime.stop(task_id, STOP_GRACE_SECONDS)
        except RuntimeError_ as exc:
            logger.warning("task %s: could not stop it: %s", task_id, exc)

    def _server_status(self, task_id: int) -> str | int | None:
        try:
            response = self.client.request("GET", f"/api/v1/tasks/{task_id}", params={"node_id": self.node_id})
        except ServerError:
            return None  # cannot tell: keep running
        if response.status_code == 404:
            return 404
        if response.status_code != 200:
            return None
        return response.json().get("status")

    # --- reports --------------------------------------------------------------------------

    def report_lost(self, task_id: int, detail: str) -> str | None:
        """Tell the server that a task it has running here has no container (or process)
        here. The server decides what becomes of it. Returns its verdict ("requeue",
        "fail", "undecided"), "moved" when the task had already moved on, or None when
        the report did not get through; either of the last two without a verdict is
        asked again by the next reconcile while the server still says running."""
        try:
            response = self.client.request(
                "POST",
                f"/api/v1/tasks/{task_id}/container-lost",
                json={"node_id": self.node_id, "detail": detail[:2000]},
            )
        except ServerError as exc:
            logger.warning("task %s: could not report its lost container (%s); the reconciler asks again", task_id, exc)
            return None
        if response.status_code == 409:
            return "moved"
        if response.status_code not in (200, 202):
            logger.error(
                "task %s: lost-container report refused: HTTP %d %s", task_id, response.status_code, response.text[:300]
            )
            return None
        verdict = response.json().get("verdict")
        logger.warning("task %s: %s; the server's verdict: %s", task_id, detail, verdict)
        return verdict

    # the delivery's, for the worker and the reconciler
    @property
    def undelivered(self) -> OrderedDict[int, Outcome]:
        return self.delivery.undelivered

    @property
    def outcome_store(self) -> OutcomeStore | None:
        return self.delivery.outcome_store

    def deliver(self, outcome: Outcome) -> bool:
        return self.delivery.deliver(outcome)

    def redeliver(self) -> int:
        return self.delivery.redeliver()

    def route(self, task: dict) -> Route | None:
        """The engine for an inference task that asks the router for one: its `serving`
        names an engine (or `auto`) and, in a container, its image is empty or `auto`;
        as a plain process, its command is empty (the agent builds the launch). None when
        the task brings its own image or command. Asked at start, so the latest probe
        counts. A task from an older server may carry `engine` and `model_format` at
        the top level instead of `serving`."""
        serving = launch.serving_of(task)
        if task.get("kind") != "inference" or not serving.get("engine"):
            return None
        if self.runtime is not None and self.runtime.kind == "process":
            if task.get("command"):
                return None
        elif (task.get("image") or AUTO) != AUTO:
            return None
        if self.router is None:
            return Route(None, None, "this agent has no engine router (it runs no tasks)")
        return self.router.choose(str(serving.get("format") or ""), str(serving["engine"]))

    def with_model(self, task: dict, cancelled=None) -> dict:
        """The task with its model made present here (model_cache.ensure) and its engine
        pointed at the local copy; a container gets that copy mounted read-only at the
        same path. Raises EnsureError, the reason already told to the control plane
        (EnsureCancelled once `cancelled()` says so: see FetchWatch)."""
        serving = launch.serving_of(task)
        ensured = (
            self.models.ensure(task["id"], serving, task.get("registry_auth"), cancelled)
            if self.models is not None
            else None
        )
        if ensured is None:
            return task
        task = {**task, "serving": {**serving, "source": ensured.source}}
        if ensured.key and getattr(self.runtime, "kind", "") == "docker":
            entry = str(self.models.store.path_of(ensured.key))
            mount = {"host": entry, "container": entry, "read_only": True}
            task["volumes"] = [*(task.get("volumes") or []), mount]
        return task

    def launched(self, task: dict, routed: Route) -> dict:
        """The task as the runtime starts it with the routed engine (task_spec.with_engine)."""
        return task_spec.with_engine(
            task, routed, runtime_kind=getattr(self.runtime, "kind", ""), engine_python=self.engine_python
        )

    # --- for the heartbeat and shutdown ----------------------------------------------------

    def report(self) -> TaskReport:
        try:
            live = {task_id for task_id, state in self.runtime.tasks().items() if state.running}
        except Exception as exc:  # an engine hiccup must not stop the beat
            logger.debug("listing tasks failed: %s", exc)
            return TaskReport()  # no live_task_ids: "cannot tell", never "none"
        with self.lock:
            health = [dict(entry) for entry in self.health.values()]
            live |= set(self.active)  # being started (an image pull may take minutes) is alive too
            serving = dict(self.serving)
        return TaskReport(live_task_ids=sorted(live), task_health=health, serving=serving)

    def close(self) -> None:
        """Stop watching (the tasks keep running; the next agent process adopts them)."""
        self.closing.set()
        with self.lock:
            for stop in self.active.values():
                stop.set()
        self.pool.shutdown(wait=True, cancel_futures=True)


class FetchWatch:
    """While a replica's model is fetched, whether to give the fetch up: the agent is
    stopping, or the server no longer wants the task (stopping or stopped, ended, or gone:
    three 404s), its intent polled every `every` seconds from a thread of its own so that
    the download never waits for the control plane. The fetch asks as bytes arrive."""

    def __init__(self, stop: threading.Event, server_status, every: float):
        self.stop, self.server_status, self.every = stop, server_status, every
        self.intent = None  # the server's, once it no longer wants the task
        self.unwanted, self.done = threading.Event(), threading.Event()

    def __enter__(self) -> FetchWatch:
        threading.Thread(target=self._poll, name="fetch-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()

    def __call__(self) -> bool:
        return self.stop.is_set() or self.unwanted.is_set()

    def _poll(self) -> None:
        gone = 0
        while not self.done.wait(self.every):
            intent = self.server_status()
            gone = gone + 1 if intent == 404 else 0
            if intent in TERMINAL or intent in CONFIRMS or gone >= GONE_AFTER_404S:
                self.intent = intent
                self.unwanted.set()
                return

    def abandoned(self, task_id: int) -> Outcome | None:
        """What a given-up fetch reports: the stop the server asked for, confirmed (nothing
        was started); nothing when the agent is stopping (the next one finds the task lost
        and the server requeues it) or the server ended or deleted it."""
        if self.intent in CONFIRMS:
            logger.info("task %s: %s on the server while its model was fetched; not started", task_id, self.intent)
            return Outcome(task_id, self.intent, CONFIRMS[self.intent], None, "")
        return None


def health_probe(task: dict) -> dict | None:
    """An inference task's health probe: its own, on its host port unless it names a
    port; a task the engine router launches (it has `serving`) is probed with GET
    /v1/models, which every routed engine answers once its model is loaded."""
    if task.get("kind") != "inference":
        return None
    probe = dict(task.get("health_probe") or {})
    if not probe and launch.serving_of(task):
        probe = {"type": "http", "path": "/v1/models"}
    if probe and not probe.get("port"):
        if not task.get("host_port"):
            return None  # nothing to knock on
        probe["port"] = int(task["host_port"])
    return probe or None


def probe_ok(probe: dict, timeout: float = 2.0) -> bool:
    """An inference task's health probe against its port on this host."""
    port = int(probe.get("port", 0))
    try:
        if probe.get("type") == "tcp":
            with socket.create_connection(("127.0.0.1", port), timeout=timeout):
                return True
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}{probe.get('path') or '/health'}", timeout=timeout
        ) as answer:
            return 200 <= answer.status < 400
    except OSError:
        return False


def host_shm_free_mb() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").free // 2**20
    except OSError:
        return None
