"""The executor: takes the tasks the scheduler sent to this node and runs them to the end.

Every poll (5 s) it asks for the node's scheduled tasks and claims each with a
compare-and-set `scheduled → running` (a 409 means another claim won: leave it). A
worker then prepares the task (volumes checked against the allow- and deny-lists, env
entries without a value dropped, the GPU visibility variables set by the agent alone),
makes the image present, starts `task-{id}` and watches it: the timeout watchdog (exit
code 124), the server's stop intent (polled every 5 s; three 404s in a row mean the
task was deleted), health probes for inference. The outcome is reported as a CAS with
the exit code and a log tail, retried for up to a minute; an outcome that still did not
get through is kept (with its container) and re-reported later, and the container is
removed only once the server has it. Kept outcomes are also written to the agent's data
directory (heteroflow_agent.outcomes), so a restarted agent still delivers them.
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
from dataclasses import asdict, dataclass
from pathlib import Path

from heteroflow_agent import checkpoint, inventory
from heteroflow_agent.client import AuthError, ServerClient, ServerError
from heteroflow_agent.engines import launch
from heteroflow_agent.engines.router import AUTO, EngineRouter, Route
from heteroflow_agent.heartbeat import TaskReport
from heteroflow_agent.outcomes import OutcomeStore
from heteroflow_agent.runtime import Runtime, RuntimeError_, TaskSpec, Volume
from heteroflow_agent.slicing import hami as hami_slices
from heteroflow_agent.slicing import mps as mps_slices

logger = logging.getLogger("heteroflow_agent.executor")

POLL_LIMIT = 20
STOP_POLL_SECONDS = 5.0
GONE_AFTER_404S = 3
TIMEOUT_EXIT_CODE = 124
MAX_UNDELIVERED = 256
STOP_GRACE_SECONDS = 10.0
TERMINAL = frozenset({"completed", "failed", "cancelled", "stopped"})
SETTLE_READS = 6  # 3 s for an ended task's exit code to appear

# The variable each vendor's runtime reads to pick the cards a process may use. The
# agent owns them: a task's own value is replaced by the allocation.
VISIBILITY_VARIABLES: dict[str, tuple[str, ...]] = {
    "nvidia": ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"),
    "amd": ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
    "hygon": ("HIP_VISIBLE_DEVICES",),
    "ascend": ("ASCEND_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"),
    "cambricon": ("MLU_VISIBLE_DEVICES",),
    "kunlun": ("XPU_VISIBLE_DEVICES",),
    "iluvatar": ("CUDA_VISIBLE_DEVICES",),
    "musa": ("MUSA_VISIBLE_DEVICES",),
    "metax": ("CUDA_VISIBLE_DEVICES", "MACA_VISIBLE_DEVICES"),
    "enflame": ("TOPS_VISIBLE_DEVICES",),
    "biren": ("BIREN_VISIBLE_DEVICES",),
}
ALL_VISIBILITY_VARIABLES = frozenset(name for names in VISIBILITY_VARIABLES.values() for name in names)

# The slice's variables (SLICES.md): the agent's alone, a task's own values are replaced.
SLICE_VARIABLES = frozenset(
    {
        "HETEROFLOW_SLICE_ID",
        "HETEROFLOW_SLICE_TIER",
        "HETEROFLOW_SLICE_QOS",
        "HETEROFLOW_GPU_MEMORY_LIMIT_MB",
        "HETEROFLOW_GPU_MEMORY_FRACTION",
        "HETEROFLOW_VDEV_CONF",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        "CUDA_MPS_PIPE_DIRECTORY",
        "CUDA_MPS_LOG_DIRECTORY",
    }
)

DEFAULT_VOLUME_ALLOW = ("/data", "/mnt", "/models", "/srv")
DEFAULT_VOLUME_DENY = (
    "/etc",
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/root",
    "/run",
    "/var/run",
    "/var/lib/docker",
    "/var/lib/containers",
    "/var/lib/heteroflow-agent",
)


def container_labels(task: dict) -> dict[str, str]:
    """What `docker ps` shows about a task: its name, tenant and its own labels (prefixed,
    so they can never pass for the agent's own heteroflow.* labels)."""
    labels = {"heteroflow.task-name": str(task.get("name", ""))[:200], "heteroflow.tenant": str(task.get("tenant", ""))}
    for key, value in (task.get("labels") or {}).items():
        labels[f"heteroflow.label.{key}"[:128]] = str(value)[:1024]
    return labels


def worker_count(cpus: int | None = None) -> int:
    return min(max(cpus or os.cpu_count() or 2, 2), 16)


def visibility_env(vendor: str, gpu_indices: list[int]) -> dict[str, str]:
    """The visibility variables for the task's cards; with no cards, none are visible."""
    value = ",".join(str(index) for index in sorted(gpu_indices))
    env = {name: value for name in VISIBILITY_VARIABLES.get(vendor, ())}
    if not gpu_indices and "NVIDIA_VISIBLE_DEVICES" in env:
        env["NVIDIA_VISIBLE_DEVICES"] = "void"  # the NVIDIA container runtime's word for "none"
    return env


def memory_only(task: dict) -> bool:
    """A share of one card (gpu_memory_mb and no whole cards): it runs only inside a
    confirmed slice."""
    return bool(task.get("gpu_memory_mb")) and task.get("gpu_required") == 0


def confirmed_slice(task: dict) -> dict | None:
    slice_ = task.get("slice")
    return slice_ if isinstance(slice_, dict) and slice_.get("state") == "confirmed" else None


def memory_fraction(slice_: dict) -> str | None:
    """memory_mb / memory_total_mb, 3 decimals, rounded down ("0.250"); None when the
    card's total is not known."""
    memory, total = slice_.get("memory_mb"), slice_.get("memory_total_mb")
    if not isinstance(memory, int) or not isinstance(total, int) or memory <= 0 or total <= 0:
        return None
    return f"{min(memory * 1000 // total, 1000) / 1000:.3f}"


def slice_env(vendor: str, slice_: dict, *, mps_pipe: str, mps_log: str) -> dict[str, str]:
    """The variables that put a task inside its confirmed slice, per tier (SLICES.md):
    mig: the card visibility is the MIG UUID; mps: the card index plus the MPS client
    limits and the daemon's directories; hami: the card index plus the vDCU's config
    file; software: the card index plus the limit the engines are asked to honour."""
    tier = str(slice_.get("tier") or "")
    index = slice_.get("gpu_index")
    env = visibility_env(vendor, [index] if isinstance(index, int) else [])
    env.update(
        {
            "HETEROFLOW_SLICE_ID": str(slice_.get("id", "")),
            "HETEROFLOW_SLICE_TIER": tier,
            "HETEROFLOW_SLICE_QOS": str(slice_.get("qos") or ""),
        }
    )
    memory = slice_.get("memory_mb")
    if tier == "mig":
        device = str(slice_.get("device_id") or "")
        env.update({name: device for name in VISIBILITY_VARIABLES["nvidia"]})
    elif tier == "mps":
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(slice_.get("compute_percent") or 100)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={memory}M"  # device 0: the one card it sees
        env["CUDA_MPS_PIPE_DIRECTORY"] = mps_pipe
        env["CUDA_MPS_LOG_DIRECTORY"] = mps_log
    elif tier == "hami":
        vdev = hami_slices.vdev_of(slice_)
        if vdev is not None:
            env["HETEROFLOW_VDEV_CONF"] = hami_slices.VDEV_IN_CONTAINER.format(vdev)
    if tier != "mig" and isinstance(memory, int):
        env["HETEROFLOW_GPU_MEMORY_LIMIT_MB"] = str(memory)
        fraction = memory_fraction(slice_)
        if fraction:
            env["HETEROFLOW_GPU_MEMORY_FRACTION"] = fraction
    return env


def checked_volumes(volumes: list[dict], allow: tuple[str, ...], deny: tuple[str, ...]) -> tuple[Volume, ...]:
    """Host paths resolved (no symlink escapes), under an allowed prefix and under no
    denied one. Raises RuntimeError_ naming the first bad one."""
    checked = []
    for volume in volumes:
        host = os.path.realpath(str(volume.get("host", "")))
        container = str(volume.get("container", ""))
        if not container.startswith("/"):
            raise RuntimeError_(f"volume {volume!r}: the container path must be absolute")
        if not any(_under(host, prefix) for prefix in allow):
            raise RuntimeError_(f"volume {volume.get('host')!r} is outside the allowed host paths ({', '.join(allow)})")
        if any(_under(host, prefix) for prefix in deny):
            raise RuntimeError_(f"volume {volume.get('host')!r} is under a denied host path")
        checked.append(Volume(host, container, bool(volume.get("read_only"))))
    return tuple(checked)


def _under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/") or "/"
    return path == prefix or path.startswith(prefix + "/") or prefix == "/"


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
        # reports: 6 attempts, 1 s doubling to 10 s, all within 60 s (then kept for the reconciler)
        self.report_client = report_client or ServerClient(
            client.base_url,
            client.session.headers["X-API-Key"],
            attempts=6,
            backoff=1.0,
            backoff_cap=10.0,
            deadline=60.0,
        )
        self.pool = ThreadPoolExecutor(max_workers=workers or worker_count(), thread_name_prefix="task")
        self.volume_allow, self.volume_deny = volume_allow, volume_deny
        self.watch_interval, self.stop_poll_seconds = watch_interval, stop_poll_seconds
        self.shm_free_mb = shm_free_mb or host_shm_free_mb
        self.active: dict[int, threading.Event] = {}  # task id -> "stop watching" (agent shutdown)
        self.health: dict[int, dict] = {}
        self.serving: dict[int, int] = {}  # inference task id -> host port (its /v1/models is read)
        self.router = router  # chooses an inference task's engine image when it asks for one
        self.engine_python = engine_python or sys.executable  # runs engines under the process runtime
        self.undelivered: OrderedDict[int, Outcome] = OrderedDict()
        self.lock = threading.Lock()
        # the undelivered outcomes on disk too (None: in memory only, as in most tests);
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
        self.closing = threading.Event()
        self.wake = threading.Event()  # set by the heartbeat when tasks wait for this node
        self.sweep = threading.Event()  # set after each heartbeat that got through: look for zombies
        self.withheld: set[int] = set()  # memory-only tasks left alone for want of a confirmed slice (logged once)
        self.mps_pipe = mps_slices.pipe_directory()
        self.mps_log = mps_slices.log_directory()

    # --- the poll -----------------------------------------------------------------------

    def poll(self) -> list[int]:
        """Fetch the node's scheduled tasks and claim them. Returns the ids claimed."""
        try:
            response = self.client.request(
                "GET", "/api/v1/tasks", params={"node_id": self.node_id, "status": "scheduled", "limit": POLL_LIMIT}
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
                    if len(self.withheld) >= MAX_UNDELIVERED:
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
                json={"node_id": self.node_id, "from_status": "scheduled", "status": "running"},
            )
        except ServerError as exc:
            logger.warning("could not claim task %s: %s", task["id"], exc)
            return False
        if response.status_code == 409:
            return False  # another claim won, or it was cancelled meanwhile
        if response.status_code != 200:
            logger.error("claiming task %s refused: HTTP %d %s", task["id"], response.status_code, response.text[:300])
            return False
        return True

    def watch_adopted(self, task: dict, started_at: float | None) -> None:
        """Watch a task that is already running (adopted), then report it. Its timeout
        counts from when it really started."""
        began = time.monotonic() - max(0.0, time.time() - started_at) if started_at else time.monotonic()
        stop = threading.Event()
        with self.lock:
            self.active[task["id"]] = stop
        self.pool.submit(self._work, task["id"], lambda: self.watch(task, stop, began))

    # --- one task -----------------------------------------------------------------------

    def _work(self, task_id: int, to_the_end) -> None:
        """A worker: run or watch the task to its end, then deliver the outcome."""
        try:
            outcome = to_the_end()
            if outcome is not None:
                self.deliver(outcome)
        except Exception:
            logger.exception("task %s: the worker failed", task_id)
        finally:
            with self.lock:
                self.active.pop(task_id, None)
                self.health.pop(task_id, None)
                self.serving.pop(task_id, None)

    def spec_for(self, task: dict) -> TaskSpec:
        env = {name: str(value) for name, value in (task.get("env") or {}).items() if name and isinstance(value, str)}
        for name in (ALL_VISIBILITY_VARIABLES | SLICE_VARIABLES) & env.keys():
            del env[name]  # the agent's to set
        env.update(visibility_env(self.vendor, task.get("gpu_indices") or []))
        slice_ = confirmed_slice(task)
        if memory_only(task) and slice_ is None:
            raise RuntimeError_("a memory-only task starts only inside a confirmed slice, and this one has none")
        agent_volumes: list[Volume] = []
        if slice_ is not None:
            env.update(slice_env(self.vendor, slice_, mps_pipe=self.mps_pipe, mps_log=self.mps_log))
            agent_volumes = self._slice_volumes(slice_)
        if task.get("host_port"):
            env["HETEROFLOW_PORT"] = str(task["host_port"])
        many_cards = len(task.get("gpu_indices") or []) > 1
        volumes = checked_volumes(task.get("volumes") or [], self.volume_allow, self.volume_deny)
        volumes += tuple(agent_volumes)  # the agent's own mounts, not subject to the task's lists
        env.pop(checkpoint.RESUME_VARIABLE, None)
        resume, decision = checkpoint.resume_point(task, volumes)
        if resume:
            env[checkpoint.RESUME_VARIABLE] = resume
        if decision:
            logger.info("task %s: %s", task["id"], decision)
            self.record_event(task["id"], "checkpoint_resume", decision, {"resume_from": resume})
        ipc_host = many_cards and task.get("kind") in ("training", "inference")
        shm_size_mb = self._shm_for(task, ipc_host)
        if slice_ is not None and slice_.get("tier") == "mps" and self._runtime_kind() == "docker":
            ipc_host = True  # an MPS client shares the daemon's IPC namespace
        return TaskSpec(
            task_id=task["id"],
            image=task.get("image") or "",
            command=list(task.get("command") or []),
            env=env,
            volumes=volumes,
            shm_size_mb=shm_size_mb,
            labels=container_labels(task),
            host_port=task.get("host_port"),
            ipc_host=ipc_host,
        )

    def _runtime_kind(self) -> str:
        return getattr(self.runtime, "kind", "")

    def _slice_volumes(self, slice_: dict) -> list[Volume]:
        """What a container needs from the host for its slice: the MPS daemon's pipe and
        log directories, or the vDCU's config file where the Hygon driver reads it. The
        process runtime shares the host's paths already; a vDCU cannot be enforced there
        (the driver reads the file only inside a container), so it refuses to start."""
        tier = slice_.get("tier")
        if tier == "hami" and self._runtime_kind() != "docker":
            raise RuntimeError_("a HAMi vDCU is enforced only inside a container; this node runs tasks as processes")
        if self._runtime_kind() != "docker":
            return []
        if tier == "mps":
            return [Volume(self.mps_pipe, self.mps_pipe, False), Volume(self.mps_log, self.mps_log, False)]
        if tier == "hami":
            vdev = hami_slices.vdev_of(slice_)
            if vdev is None:
                raise RuntimeError_(f"the slice names no vDCU (device id {slice_.get('device_id')!r})")
            return [Volume(hami_slices.VDEV_CONF.format(vdev), hami_slices.VDEV_IN_CONTAINER.format(vdev), True)]
        return []

    def _shm_for(self, task: dict, ipc_host: bool) -> int | None:
        """The task's `shm_size_mb` label sizes its /dev/shm. With --ipc=host the host's
        /dev/shm is shared instead, and an inference engine that needs more of it than
        the host has free is refused now rather than started to die (1 GiB per card
        unless the label says otherwise)."""
        labels = task.get("labels") or {}
        try:
            wanted = int(labels["shm_size_mb"]) if "shm_size_mb" in labels else None
        except (TypeError, ValueError):
            raise RuntimeError_(f"label shm_size_mb={labels['shm_size_mb']!r} is not a whole number of MB") from None
        if not ipc_host:
            return wanted
        engine = inference_engine(task.get("image") or "")
        if engine:
            needed = wanted or 1024 * len(task.get("gpu_indices") or [])
            free = self.shm_free_mb()
            if free is not None and free < needed:
                raise RuntimeError_(
                    f"{engine} on {len(task.get('gpu_indices') or [])} cards needs {needed} MB of /dev/shm "
                    f"and the host has {free} MB free; enlarge the host's /dev/shm (or set the task label shm_size_mb)"
                )
        return None

    def run(self, task: dict, stop: threading.Event) -> Outcome | None:
        """Start the task and watch it to its end. The outcome to report, or None when
        there is nothing to report (the task was deleted, or the agent is stopping)."""
        return of_attempt(task, self._run(task, stop))

    def _run(self, task: dict, stop: threading.Event) -> Outcome | None:
        task_id = task["id"]
        if task.get("missing_secrets"):
            # the tenant deleted a secret the task needs: running without it would be wrong
            missing = ", ".join(task["missing_secrets"])
            return Outcome(
                task_id, "running", "failed", None, f"could not start: the tenant has no secret named {missing}"
            )
        routed = self.route(task)
        if routed is not None and routed.refused:
            return Outcome(task_id, "running", "failed", None, f"could not start: {routed.reason}"[:2000])
        if routed is not None:
            logger.info("task %s: engine %s (%s)", task_id, routed.image, routed.reason)
            try:
                task = self.launched(task, routed)
            except launch.LaunchError as exc:
                return Outcome(task_id, "running", "failed", None, f"could not start: {exc}"[:2000])
        try:
            spec = self.spec_for(task)
            if self.runtime.kind == "docker":
                self.runtime.ensure_image(spec.image, task.get("registry_auth"))
            self.runtime.start(spec)
        except RuntimeError_ as exc:
            return Outcome(task_id, "running", "failed", None, f"could not start: {exc}")
        logger.info("task %s started (%s)", task_id, self.runtime.kind)
        return self._watch(task, stop, time.monotonic())

    def watch(self, task: dict, stop: threading.Event, started: float) -> Outcome | None:
        return of_attempt(task, self._watch(task, stop, started))

    def _watch(self, task: dict, stop: threading.Event, started: float) -> Outcome | None:
        task_id = task["id"]
        deadline = started + (task.get("timeout_seconds") or 7200)
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
                status = "completed" if code == 0 else "failed"
                message = (
                    ""
                    if code == 0
                    else (f"exited with code {code}" if code is not None else "ended, exit code unknown")
                )
                return Outcome(task_id, "running", status, code, message, self.runtime.logs_tail(task_id))
            now = time.monotonic()
            if now >= deadline:
                self._stop(task_id)
                limit = task.get("timeout_seconds") or 7200
                return Outcome(
                    task_id,
                    "running",
                    "failed",
                    TIMEOUT_EXIT_CODE,
                    f"timed out after {limit} s",
                    self.runtime.logs_tail(task_id),
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
                if intent in ("stopping", "preempting"):
                    self._stop(task_id)
                    try:
                        final = self.runtime.state(task_id)
                    except RuntimeError_:
                        final = None
                    code = final.exit_code if final else None
                    to = "stopped" if intent == "stopping" else "pending"
                    return Outcome(task_id, intent, to, code, "", self.runtime.logs_tail(task_id))
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

    def deliver(self, outcome: Outcome) -> bool:
        """Report the outcome (CAS). Delivered (or moot): the container is removed. Not
        delivered: it is kept, and so is the outcome, for a later attempt."""
        body = {
            "node_id": self.node_id,
            "from_status": outcome.from_status,
            "status": outcome.status,
            "exit_code": outcome.exit_code,
            "error_message": outcome.error_message[:10_000],
            "log_tail": outcome.log_tail[-64 * 1024 :],
        }
        if outcome.attempt is not None:
            body["attempt"] = outcome.attempt
        try:
            response = self.report_client.request("PUT", f"/api/v1/tasks/{outcome.task_id}", json=body)
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

    def launched(self, task: dict, routed: Route) -> dict:
        """The task as the runtime starts it with the routed engine: as a plain process,
        the engine's module under the engine interpreter; in a container, the engine's
        image (and its server's command line when the task gives none). Raises
        launch.LaunchError when its serving cannot be launched."""
        serving = launch.serving_of(task)
        slice_ = confirmed_slice(task)
        if slice_ is not None and slice_.get("tier") != "mig":
            # a share of a card: the engine is told how much of it is its own
            serving = launch.with_memory_fraction(routed.engine, serving, memory_fraction(slice_))
        if self.runtime is not None and self.runtime.kind == "process":
            argv = launch.process_argv(routed.engine, self.engine_python, serving, task.get("host_port"))
            return {**task, "command": argv}
        launched = {**task, "image": routed.image}
        if not task.get("command") and serving.get("source"):
            launched["command"] = launch.container_argv(routed.engine, serving, task.get("host_port"))
        return launched

    def redeliver(self) -> int:
        """Try the kept outcomes again (reconcile). Returns how many got through."""
        with self.lock:
            pending = list(self.undelivered.values())
        return sum(1 for outcome in pending if self.deliver(outcome))

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


def inference_engine(image: str) -> str:
    """The engine a task image is, by the same exact repository names the heartbeat uses."""
    repository = image.rsplit("@", 1)[0]
    name, _, tag = repository.rpartition(":")
    if not name or "/" in tag:
        name = repository
    return next((engine for engine, names in inventory.ENGINE_IMAGES.items() if name in names), "")
