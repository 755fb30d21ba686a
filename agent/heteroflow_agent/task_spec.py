"""What the runtime launches for a task: the task as the server handed it out turned into
a TaskSpec (its image, command, env, mounts, /dev/shm and IPC namespace, labels), by the
node's rules. No calls to the server and no state: the executor asks, then starts what
comes back.

- Volumes resolve (symbolic links followed) under an allowed host prefix and under no
  denied one; the agent's own mounts for a slice (the MPS daemon's directories, a vDCU's
  config file) are added after that check.
- Env entries without a string value are dropped. The GPU visibility variables and the
  slice's variables are the agent's alone: a task's own values are replaced by the
  allocation and the confirmed slice (SLICES.md). A memory-only task starts only inside
  a confirmed slice.
- A training task with a checkpoint path on one of its volumes resumes from the newest
  complete checkpoint there (heteroflow_agent.checkpoint); the decision comes back with
  the spec, for the task's history.
- An inference task the engine router launches gets the routed engine's image or module
  and its command line (heteroflow_agent.engines.launch).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from heteroflow_agent import checkpoint, inventory
from heteroflow_agent.engines import launch
from heteroflow_agent.engines.router import Route
from heteroflow_agent.runtime import RuntimeError_, TaskSpec, Volume
from heteroflow_agent.slicing import hami as hami_slices

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


@dataclass(frozen=True)
class NodeRules:
    """What of the node a task's spec depends on: its vendor, what runs its tasks
    ("docker", "process", or "" for none), the operator's volume lists, the MPS daemon's
    directories, and how much of the host's /dev/shm is free (asked only when an engine
    on several cards would share it)."""

    vendor: str = ""
    runtime_kind: str = ""
    volume_allow: tuple[str, ...] = DEFAULT_VOLUME_ALLOW
    volume_deny: tuple[str, ...] = DEFAULT_VOLUME_DENY
    mps_pipe: str = ""
    mps_log: str = ""
    shm_free_mb: Callable[[], int | None] = lambda: None


def build(task: dict, rules: NodeRules) -> tuple[TaskSpec, str]:
    """The task's spec, and what was decided about resuming it from a checkpoint ("" when
    it has no checkpoint path). Raises RuntimeError_ saying why the task cannot start
    here (a bad volume, no confirmed slice for a memory-only task, too little /dev/shm…)."""
    env = {name: str(value) for name, value in (task.get("env") or {}).items() if name and isinstance(value, str)}
    for name in (ALL_VISIBILITY_VARIABLES | SLICE_VARIABLES) & env.keys():
        del env[name]  # the agent's to set
    env.update(visibility_env(rules.vendor, task.get("gpu_indices") or []))
    slice_ = confirmed_slice(task)
    if memory_only(task) and slice_ is None:
        raise RuntimeError_("a memory-only task starts only inside a confirmed slice, and this one has none")
    agent_volumes: list[Volume] = []
    if slice_ is not None:
        env.update(slice_env(rules.vendor, slice_, mps_pipe=rules.mps_pipe, mps_log=rules.mps_log))
        agent_volumes = slice_volumes(slice_, rules)
    if task.get("host_port"):
        env["HETEROFLOW_PORT"] = str(task["host_port"])
    many_cards = len(task.get("gpu_indices") or []) > 1
    volumes = checked_volumes(task.get("volumes") or [], rules.volume_allow, rules.volume_deny)
    volumes += tuple(agent_volumes)  # the agent's own mounts, not subject to the task's lists
    env.pop(checkpoint.RESUME_VARIABLE, None)
    resume, decision = checkpoint.resume_point(task, volumes)
    if resume:
        env[checkpoint.RESUME_VARIABLE] = resume
    ipc_host = many_cards and task.get("kind") in ("training", "inference")
    shm_size_mb = shm_for(task, ipc_host, rules.shm_free_mb)
    if slice_ is not None and slice_.get("tier") == "mps" and rules.runtime_kind == "docker":
        ipc_host = True  # an MPS client shares the daemon's IPC namespace
    spec = TaskSpec(
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
    return spec, decision


def with_engine(task: dict, routed: Route, *, runtime_kind: str, engine_python: str) -> dict:
    """The task as the runtime starts it with the routed engine: as a plain process, the
    engine's module under the engine interpreter; in a container, the engine's image (and
    its server's command line when the task gives none). Raises launch.LaunchError when
    its serving cannot be launched."""
    serving = launch.serving_of(task)
    slice_ = confirmed_slice(task)
    if slice_ is not None and slice_.get("tier") != "mig":
        # a share of a card: the engine is told how much of it is its own
        serving = launch.with_memory_fraction(routed.engine, serving, memory_fraction(slice_))
    if runtime_kind == "process":
        argv = launch.process_argv(routed.engine, engine_python, serving, task.get("host_port"))
        return {**task, "command": argv}
    launched = {**task, "image": routed.image}
    if not task.get("command") and serving.get("source"):
        launched["command"] = launch.container_argv(routed.engine, serving, task.get("host_port"))
    return launched


def container_labels(task: dict) -> dict[str, str]:
    """What `docker ps` shows about a task: its name, tenant and its own labels (prefixed,
    so they can never pass for the agent's own heteroflow.* labels)."""
    labels = {"heteroflow.task-name": str(task.get("name", ""))[:200], "heteroflow.tenant": str(task.get("tenant", ""))}
    for key, value in (task.get("labels") or {}).items():
        labels[f"heteroflow.label.{key}"[:128]] = str(value)[:1024]
    return labels


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


def slice_volumes(slice_: dict, rules: NodeRules) -> list[Volume]:
    """What a container needs from the host for its slice: the MPS daemon's pipe and
    log directories, or the vDCU's config file where the Hygon driver reads it. The
    process runtime shares the host's paths already; a vDCU cannot be enforced there
    (the driver reads the file only inside a container), so it refuses to start."""
    tier = slice_.get("tier")
    if tier == "hami" and rules.runtime_kind != "docker":
        raise RuntimeError_("a HAMi vDCU is enforced only inside a container; this node runs tasks as processes")
    if rules.runtime_kind != "docker":
        return []
    if tier == "mps":
        return [Volume(rules.mps_pipe, rules.mps_pipe, False), Volume(rules.mps_log, rules.mps_log, False)]
    if tier == "hami":
        vdev = hami_slices.vdev_of(slice_)
        if vdev is None:
            raise RuntimeError_(f"the slice names no vDCU (device id {slice_.get('device_id')!r})")
        return [Volume(hami_slices.VDEV_CONF.format(vdev), hami_slices.VDEV_IN_CONTAINER.format(vdev), True)]
    return []


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


def shm_for(task: dict, ipc_host: bool, shm_free_mb: Callable[[], int | None]) -> int | None:
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
        free = shm_free_mb()
        if free is not None and free < needed:
            raise RuntimeError_(
                f"{engine} on {len(task.get('gpu_indices') or [])} cards needs {needed} MB of /dev/shm "
                f"and the host has {free} MB free; enlarge the host's /dev/shm (or set the task label shm_size_mb)"
            )
    return None


def inference_engine(image: str) -> str:
    """The engine a task image is, by the same exact repository names the heartbeat uses."""
    repository = image.rsplit("@", 1)[0]
    name, _, tag = repository.rpartition(":")
    if not name or "/" in tag:
        name = repository
    return next((engine for engine, names in inventory.ENGINE_IMAGES.items() if name in names), "")
