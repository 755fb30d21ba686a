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
    INTERACTIVE = "interactive"  # an app a person works in (docs/interactive.md)


class InteractiveApp(models.TextChoices):
    """What an interactive task runs (the agent starts it, bound to localhost in the task):
    a Jupyter server, or nothing but a shell to enter (the portal's terminal, hf ssh)."""

    JUPYTER = "jupyter"
    SHELL = "shell"


class TaskRuntime(models.TextChoices):
    """Which of a node's runtimes a task accepts (the node's `exec_mode` says which it
    has): `auto` whichever the node has (a container engine's, else the process
    runtime's, where the image is ignored), `container` only a container engine,
    `process` only the process runtime (a command on the host; no image needed)."""

    AUTO = "auto"
    CONTAINER = "container"
    PROCESS = "process"


# Hard placement constraints (Task.affinity, Task.anti_affinity; a group's, for its
# members): at most this many labels in one selector. A label's key is spelled as the
# agents and the node API spell node labels.
MAX_SELECTOR_LABELS = 16
NODE_LABEL_KEY = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$"
NODE_LABEL_VALUE_MAX = 4096


# What one task may ask for, wherever a task is described (a task, a group's worker, an
# inference service's replica, the scheduler's dry runs): the API refuses more. The
# database checks the same priority bounds (the task_priority_0_100 constraints).
MAX_GPUS_PER_TASK = 64
# the longest a task may be given to run (its timeout, its declared duration): 31 days
MAX_TASK_SECONDS = 31 * 86_400
MIN_PRIORITY, MAX_PRIORITY = 0, 100
DEFAULT_PRIORITY = 50

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


# --- task groups (multi-worker training; inference groups use the same model) ------------


class GroupKind(models.TextChoices):
    TRAINING = "training"
    INFERENCE = "inference"


class GroupPlacement(models.TextChoices):
    """How the scheduler places a group's members: `gang` all or nothing in one cycle (a
    training job, a multi-node engine), `replicas` each member on its own like a single task
    (an inference service's replicas: one that dies is rebuilt while the others serve)."""

    GANG = "gang"
    REPLICAS = "replicas"


class GroupStrategy(models.TextChoices):
    """How the workers split the model; it decides how placement spreads them (tp packs
    within a node, pp spreads across nodes, the data-parallel ones pack first)."""

    DDP = "ddp"
    DEEPSPEED = "deepspeed"
    FSDP = "fsdp"
    TP = "tp"
    PP = "pp"


class GroupStatus(models.TextChoices):
    PENDING = "pending"
    SCHEDULED = "scheduled"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


# member statuses that mean the attempt is being ended (a stop, a preemption, a drain)
ENDING = frozenset({S.STOPPING, S.DRAINING, S.PREEMPTING})


# a replica bound to its node and not being ended (placed, starting, waking, asleep, paused)
BOUND_NOT_ENDING = frozenset(HOLDING) - ENDING - {S.RUNNING}


def group_status(member_statuses, placement: str = GroupPlacement.GANG) -> str:
    """A group's status, derived from its members' (never stored, so it cannot drift).
    A gang group (all members or none):
    - every member ended: failed if one failed, stopped if one was stopped or cancelled,
      else completed;
    - a member being stopped, or one failed or stopped while others still run: stopping
      (the attempt is being ended as a whole);
    - every member pending (or no members yet): pending;
    - every member running or already completed: running;
    - otherwise (bound, not every worker started): scheduled.
    A replicas group (an inference service: each replica on its own, a dead one rebuilt
    while the others serve) is judged by its current members (those not ended), the
    ended ones only when every member has ended (then as a gang's):
    - a replica running: running (it serves);
    - else one bound and not being ended (scheduled, starting, waking, …): scheduled;
    - else one waiting for placement: pending;
    - else (every current replica being stopped or evicted): stopping."""
    statuses = list(member_statuses)
    if not statuses:
        return GroupStatus.PENDING
    ended = [status for status in statuses if status in TERMINAL]
    if len(ended) == len(statuses):
        if S.FAILED in ended:
            return GroupStatus.FAILED
        if S.STOPPED in ended or S.CANCELLED in ended:
            return GroupStatus.STOPPED
        return GroupStatus.COMPLETED
    if placement == GroupPlacement.REPLICAS:
        if S.RUNNING in statuses:
            return GroupStatus.RUNNING
        if any(status in BOUND_NOT_ENDING for status in statuses):
            return GroupStatus.SCHEDULED
        if S.PENDING in statuses:
            return GroupStatus.PENDING
        return GroupStatus.STOPPING
    if any(status in ENDING for status in statuses) or any(status != S.COMPLETED for status in ended):
        return GroupStatus.STOPPING
    if all(status == S.PENDING for status in statuses):
        return GroupStatus.PENDING
    if all(status in (S.RUNNING, S.COMPLETED) for status in statuses):
        return GroupStatus.RUNNING
    return GroupStatus.SCHEDULED
