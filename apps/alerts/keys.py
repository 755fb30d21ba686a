"""Alert keys: the one place they are spelled. The alerts table allows one ACTIVE alert
per key, so a key says which happenings are "the same alert" (raising it again while it
is active does nothing) and lets whoever ends the condition find the alert to recover.

Each key starts with its own prefix, so keys of two types never collide. They come in two
spellings for historical reasons: GPU_LOST's prefix is its type, the others are
kebab-case. The spellings are kept as they are: a renamed key would not find the alert
raised under the old one, so a condition still active at the upgrade would be raised a
second time (two active alerts for one lost card) and the old one never recovered.

The heartbeat raises and recovers GPU_LOST and GPU_MEMORY_DRIFT inside its own
statement: gpu_lost_sql and gpu_memory_drift_sql build the same keys there.
"""

from __future__ import annotations

from datetime import datetime

GPU_LOST_PREFIX = "GPU_LOST:"
SCHEDULER_STALLED = "scheduler-stalled"


def gpu_lost(node_id: str, index: int) -> str:
    return f"{GPU_LOST_PREFIX}{node_id}:{index}"


def gpu_lost_sql(node_id_param: str, index_expr: str) -> str:
    """gpu_lost in SQL, e.g. gpu_lost_sql("%(id)s", "j.index")."""
    return f"'{GPU_LOST_PREFIX}' || {node_id_param} || ':' || {index_expr}"


def node_offline(node_id: str) -> str:
    return f"node-offline:{node_id}"


def gpu_driver_error(node_id: str) -> str:
    return f"gpu-driver-error:{node_id}"


def task_failed(task_id: int) -> str:
    return f"task-failed:{task_id}"


def interactive_idle(task_id: int) -> str:
    return f"interactive-idle:task:{task_id}"


def task_requeued(task_id: int, at: datetime) -> str:
    """The key carries the moment: a task requeued again later alerts again."""
    return f"task-requeued:{task_id}:{at.timestamp():.3f}"


def preemption_timeout(task_id: int) -> str:
    return f"preemption-timeout:task:{task_id}"


def quota_exceeded(tenant_id: int) -> str:
    return f"quota-exceeded:tenant:{tenant_id}"


def inference_crash_loop(task_id: int) -> str:
    """An inference replica's slot (its task row, requeued on each rebuild) crash-looping."""
    return f"inference-crash-loop:task:{task_id}"


def inference_wake_timed_out(service_id: int, at: datetime) -> str:
    """The key carries the moment: a later wake that times out alerts again."""
    return f"inference-wake-timed-out:{service_id}:{at.timestamp():.3f}"


def gpu_unhealthy(node_id: str, index: int) -> str:
    return f"gpu-unhealthy:{node_id}:{index}"


GPU_MEMORY_DRIFT_PREFIX = "gpu-memory-drift:"


def gpu_memory_drift(node_id: str, index: int) -> str:
    return f"{GPU_MEMORY_DRIFT_PREFIX}{node_id}:{index}"


def gpu_memory_drift_sql(node_id_param: str, index_expr: str) -> str:
    """gpu_memory_drift in SQL, for the heartbeat's statement."""
    return f"'{GPU_MEMORY_DRIFT_PREFIX}' || {node_id_param} || ':' || {index_expr}"


GATEWAY_REDIS_AWAY = "gateway-redis-away"  # one for the cluster: whichever gateway process sees Redis back recovers it
