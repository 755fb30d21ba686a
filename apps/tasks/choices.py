from django.db import models


class TaskStatus(models.TextChoices):
    PENDING = "pending"
    SCHEDULED = "scheduled"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    DRAINING = "draining"
    SLEEPING = "sleeping"
    WAKING = "waking"
    PAUSED = "paused"
    PREEMPTING = "preempting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"


class TaskKind(models.TextChoices):
    JOB = "job"
    TRAINING = "training"
    INFERENCE = "inference"


S = TaskStatus
TERMINAL = (S.COMPLETED, S.FAILED, S.CANCELLED, S.STOPPED)
ACTIVE = tuple(status for status in S if status not in TERMINAL)
# Statuses that hold resources on a node (the GPU ledger counts them). Transitional
# states keep counting until the resources are really given back.
HOLDING = tuple(status for status in ACTIVE if status != S.PENDING)

# The allowed-transition table: the only moves any code may make (apps.core.cas).
TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.SCHEDULED, S.CANCELLED, S.FAILED}),
    # requeue (node lost, bind rolled back), agent claim, user stop/cancel, failures
    # (preempting from scheduled/starting: only with preempt_stage "scheduled")
    S.SCHEDULED: frozenset({S.STARTING, S.RUNNING, S.PENDING, S.STOPPING, S.CANCELLED, S.FAILED, S.PREEMPTING}),
    S.STARTING: frozenset({S.RUNNING, S.PENDING, S.STOPPING, S.FAILED, S.PREEMPTING}),
    S.RUNNING: frozenset(
        {
            S.COMPLETED,
            S.FAILED,
            S.STOPPING,
            S.DRAINING,
            S.PREEMPTING,
            S.PENDING,
            S.SLEEPING,
            S.PAUSED,
        }
    ),
    S.STOPPING: frozenset({S.STOPPED, S.FAILED}),
    S.DRAINING: frozenset({S.COMPLETED, S.FAILED, S.STOPPED}),
    S.SLEEPING: frozenset({S.WAKING, S.STOPPING, S.STOPPED}),
    S.WAKING: frozenset({S.RUNNING, S.SLEEPING, S.PENDING, S.FAILED}),
    S.PAUSED: frozenset({S.RUNNING, S.STOPPING, S.CANCELLED}),
    # a task being preempted goes back to the queue (or fails); it never "completes"
    S.PREEMPTING: frozenset({S.PENDING, S.FAILED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
    S.STOPPED: frozenset(),
}
