"""Every state change of tasks. Status moves only through move_tasks(): the CAS
(apps.core.cas.transition) plus what follows from a move, in the same transaction."""

from __future__ import annotations

import logging
import time

from django.conf import settings
from django.core.cache import cache
from django.db import connection, transaction
from django.db.models import F

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.services import NewAlert, raise_alert, raise_alerts
from apps.confidential.services import read_secret
from apps.core.cas import IllegalTransition, transition
from apps.core.clock import utcnow
from apps.core.db import insert_rows
from apps.core.enqueue import enqueue
from apps.core.errors import Conflict
from apps.scheduler.ledger import release
from apps.tasks.choices import TERMINAL, TRANSITIONS
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task, TaskEvent, TenantUsage

logger = logging.getLogger(__name__)

# moves after which a task holds nothing on a node any more
OFF_NODE = frozenset(TERMINAL) | {S.PENDING}


def move_tasks(task_ids, from_statuses, to_status, **changes) -> list[int]:
    """Move tasks by CAS and apply what follows, in one transaction: a run's GPU time is
    counted when it ends (to the queue or for good), the cards and host port are given
    back, usage is settled once when the task ends, and a failure raises TASK_FAILED.
    Returns the ids that won; a loser changes nothing."""
    ids = [task_ids] if isinstance(task_ids, int) else list(task_ids)
    if not ids:
        return []
    now = utcnow()
    if to_status == S.RUNNING:
        changes.setdefault("running_since", now)
    if to_status in TERMINAL:
        changes.setdefault("finished_at", now)
    if to_status != S.RUNNING:
        changes.setdefault("missing_since", None)
    with transaction.atomic():
        won = transition(Task, TRANSITIONS, ids, from_statuses, to_status, **changes)
        if won and to_status in OFF_NODE:
            _count_gpu_time(won, now)
            release(won)
            if to_status in TERMINAL:
                _settle_usage(won, now)
            if to_status == S.FAILED:
                _alert_failures(won)
    return won


def _count_gpu_time(task_ids, now) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            """UPDATE tasks SET gpu_seconds = gpu_seconds
                   + gpu_required * GREATEST(0, EXTRACT(EPOCH FROM (%s - running_since))),
                   running_since = NULL
               WHERE id = ANY(%s) AND running_since IS NOT NULL""",
            [now, list(task_ids)],
        )


def _settle_usage(task_ids, now) -> None:
    """Once per task: the unique task_id makes a second settlement a no-op."""
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO usage_records (task_id, tenant_id, gpus, gpu_seconds, ended_status, settled_at)
               SELECT id, tenant_id, gpu_required, gpu_seconds, status, %s FROM tasks
               WHERE id = ANY(%s) AND status = ANY(%s)
               ON CONFLICT (task_id) DO NOTHING""",
            [now, list(task_ids), list(TERMINAL)],
        )


def _alert_failures(task_ids) -> None:
    raise_alerts(
        [
            NewAlert(
                type=AlertType.TASK_FAILED,
                severity=Severity.WARNING,
                scope=AlertScope.TASK,
                key=alert_keys.task_failed(pk),
                message=f"Task {name} ({pk}) failed" + (f": {error[:300]}" if error else ""),
                node_id=node_id or "",
                task_id=pk,
                tenant_id=tenant_id,
                details={"exit_code": exit_code},
            )
            for pk, name, tenant_id, node_id, error, exit_code in Task.objects.filter(pk__in=task_ids).values_list(
                "pk", "name", "tenant_id", "node_id", "error_message", "exit_code"
            )
        ]
    )


def quota_use(tenant) -> dict:
    """What the tenant's active tasks hold (tasks, GPUs, GPU memory per GPU asked for):
    its counter row (models.TenantUsage), which the triggers on `tasks` keep equal to a
    count of its active tasks."""
    row = TenantUsage.objects.filter(tenant_id=tenant.pk).first()
    return row.as_use() if row else {"tasks": 0, "gpus": 0, "gpu_memory_mb": 0}


def quota_problems(tenant, use: dict, *, gpus: int, gpu_memory_mb: int, tasks: int = 1) -> list[str]:
    """Why `tasks` more tasks asking `gpus` GPUs and `gpu_memory_mb` MB in all would not
    fit the tenant's quota, given its `use` (empty: they fit)."""
    more = f", {tasks} more asked" if tasks != 1 else ""
    problems = []
    if tenant.max_concurrent_tasks is not None and use["tasks"] + tasks > tenant.max_concurrent_tasks:
        problems.append(f"{use['tasks']} of {tenant.max_concurrent_tasks} concurrent tasks in use{more}")
    if tenant.max_gpus is not None and use["gpus"] + gpus > tenant.max_gpus:
        problems.append(f"{use['gpus']} of {tenant.max_gpus} GPUs in use, {gpus} more asked")
    if tenant.max_gpu_memory_mb is not None and use["gpu_memory_mb"] + gpu_memory_mb > tenant.max_gpu_memory_mb:
        problems.append(
            f"{use['gpu_memory_mb']} of {tenant.max_gpu_memory_mb} MB GPU memory in use, {gpu_memory_mb} more asked"
        )
    return problems


def create_task(*, tenant, created_by=None, **fields) -> Task:
    """Queue one task (create_tasks with one spec)."""
    return create_tasks(tenant, [fields], created_by=created_by)[0]


INSERT_BATCH = 1000  # rows per INSERT statement of a batch


def create_tasks(tenant, specs, *, created_by=None) -> list[Task]:
    """Queue tasks, all or none: `specs` are Task fields, one dict per task. The quota is
    checked once for them all against the tenant's usage row, locked (FOR UPDATE) for
    the check and the insert, so two concurrent creates cannot both pass a quota with
    room for one; the triggers on `tasks` add the new rows to that counter in the same
    transaction. The rows are built before the lock is taken, so the critical section
    is two statements: the lock and the (bulk) insert. Conflict (quota_exceeded) when
    they do not fit: nothing is created."""
    tasks = [Task(tenant=tenant, created_by=created_by, **spec) for spec in specs]
    if not tasks:
        return []
    gpus = sum(task.gpu_required for task in tasks)
    memory = sum((task.gpu_memory_mb or 0) * max(task.gpu_required, 1) for task in tasks)
    with transaction.atomic():
        use = TenantUsage.objects.locked(tenant.pk).as_use()
        problems = quota_problems(tenant, use, tasks=len(tasks), gpus=gpus, gpu_memory_mb=memory)
        if not problems:
            insert_rows(tasks, batch_size=INSERT_BATCH)
            transaction.on_commit(ask_for_a_cycle)
            return tasks
    message = f"Quota of tenant '{tenant.slug}' exceeded: {'; '.join(problems)}."
    _alert_quota(tenant, message)
    raise Conflict(message, "quota_exceeded")


CYCLE_ASKED_KEY = "tasks:cycle-asked"
# Until when (time.monotonic) the cycle this process itself asked for at an interval's
# end is still to come: a create committed before then is seen by it, without asking Redis.
_own_cycle_due = [0.0]


def ask_for_a_cycle() -> None:
    """A scheduler cycle for tasks just committed, asked at most once per
    HETEROFLOW_SUBMIT_TICK_SECONDS however many creates commit meanwhile: the first
    create of an interval sends a cycle now and one at the interval's end, which sees
    every task committed before it (each create asks only after its commit). Within an
    interval this process opened, its creates do not even ask Redis. 0: a cycle per
    create."""
    interval = settings.HETEROFLOW_SUBMIT_TICK_SECONDS
    if interval <= 0:
        enqueue("scheduler.tick", immediate=True)
        return
    now = time.monotonic()
    if now < _own_cycle_due[0]:
        return
    try:
        first = cache.add(CYCLE_ASKED_KEY, 1, timeout=interval)
    except Exception:  # Redis away: the broker is too, and the 5 s tick catches up
        logger.warning("could not ask for a scheduler cycle", exc_info=True)
        return
    if first:
        enqueue("scheduler.tick", immediate=True)
        enqueue("scheduler.tick", immediate=True, countdown=interval)
        _own_cycle_due[0] = now + interval  # the countdown runs no earlier than this


def forget_cycle_asks() -> None:
    """Start afresh (tests): no interval open, here or in Redis."""
    _own_cycle_due[0] = 0.0
    cache.delete(CYCLE_ASKED_KEY)


def _alert_quota(tenant, message: str) -> None:
    """One active QUOTA_EXCEEDED per tenant; the alert sweep recovers it once the tenant
    is under its quota again."""
    raise_alert(
        type=AlertType.QUOTA_EXCEEDED,
        severity=Severity.WARNING,
        scope=AlertScope.TENANT,
        key=alert_keys.quota_exceeded(tenant.pk),
        message=f"A task was refused. {message}",
        tenant_id=tenant.pk,
    )


# Asking a task to stop: queued tasks are cancelled outright; tasks with a container
# get the stop intent (stopping) and the agent reports the end.
CANCEL_FROM = (S.PENDING, S.SCHEDULED, S.PAUSED)
STOP_FROM = (S.STARTING, S.RUNNING, S.SLEEPING)


def stop_tasks(task_ids) -> list[int]:
    """The stop intent for several tasks at once (a group's members): the queued ones
    cancelled, the ones with a container moved to stopping. The ids that moved."""
    task_ids = list(task_ids)
    with transaction.atomic():
        cancelled = set(move_tasks(task_ids, CANCEL_FROM, S.CANCELLED))
        rest = [pk for pk in task_ids if pk not in cancelled]
        return sorted(cancelled) + move_tasks(rest, STOP_FROM, S.STOPPING)


def stop_task(task: Task) -> Task:
    with transaction.atomic():
        if not stop_tasks([task.pk]):
            task.refresh_from_db()
            if task.status not in TERMINAL and task.status != S.STOPPING:
                raise Conflict(f"Task {task.pk} is {task.status} and cannot be stopped now.", "invalid_state")
            # already ending: asking again is not an error
    task.refresh_from_db()
    return task


# What an agent may report, from each state it may see.
AGENT_MOVES: dict[str, frozenset[str]] = {
    S.SCHEDULED: frozenset({S.RUNNING, S.STARTING, S.FAILED}),
    S.STARTING: frozenset({S.RUNNING, S.FAILED}),
    S.RUNNING: frozenset({S.COMPLETED, S.FAILED}),
    S.STOPPING: frozenset({S.STOPPED, S.FAILED}),
    S.DRAINING: frozenset({S.COMPLETED, S.FAILED, S.STOPPED}),
    S.PREEMPTING: frozenset({S.PENDING}),
    S.WAKING: frozenset({S.RUNNING, S.FAILED}),
}


def agent_report(
    task: Task, *, from_status: str, to_status: str, exit_code=None, error_message: str = "", log_tail: str = ""
) -> bool:
    """An agent's report, as a CAS from the status it saw. False: it lost (someone moved
    the task first, or the same report was already applied); nothing changed."""
    if to_status not in AGENT_MOVES.get(from_status, frozenset()):
        raise IllegalTransition(f"an agent cannot move a task from {from_status} to {to_status}")
    changes: dict = {}
    if to_status == S.RUNNING:
        changes["started_at"] = utcnow()
    if to_status in TERMINAL:
        changes.update(exit_code=exit_code, error_message=error_message[:10_000], log_tail=log_tail)
    if to_status == S.PENDING:  # a preempted task's stop is confirmed: back to the queue
        return bool(requeue_preempted([task.pk]))
    return bool(move_tasks(task.pk, [from_status], to_status, **changes))


def requeue_preempted(task_ids) -> list[int]:
    """preempting → pending, once the stop is confirmed (by the agent, or forced by the
    watchdog): only now are the cards given back. The task returns to the queue off
    its node, with preempt_count + 1 and preemptible=false so that it is not preempted
    again and again. Of a late confirmation and the watchdog, one CAS wins; the other
    changes nothing."""
    return move_tasks(
        list(task_ids),
        [S.PREEMPTING],
        S.PENDING,
        node=None,
        host_port=None,
        preempt_count=F("preempt_count") + 1,
        preemptible=False,
    )


# A member of an array learns its place from these; a task's own env cannot set them.
ARRAY_VARIABLES = frozenset({"HETEROFLOW_ARRAY_INDEX", "HETEROFLOW_ARRAY_SIZE"})


def resolve_env(task: Task) -> tuple[dict[str, str], list[str]]:
    """The task's environment with secret references resolved from the tenant's own
    schema, at hand-out time (values never leave that schema otherwise), and an array
    member's HETEROFLOW_ARRAY_INDEX / HETEROFLOW_ARRAY_SIZE, which override the task's own."""
    resolved, missing = {}, []
    for name, value in (task.env or {}).items():
        if name in ARRAY_VARIABLES:
            continue  # the server's to set
        if isinstance(value, dict):
            secret = read_secret(task.tenant, value["secret"])
            if secret is None:
                missing.append(value["secret"])
                continue
            resolved[name] = secret
        else:
            resolved[name] = value
    if task.array_size is not None:
        resolved.update(HETEROFLOW_ARRAY_INDEX=str(task.array_index), HETEROFLOW_ARRAY_SIZE=str(task.array_size))
    return resolved, missing


def resolve_registry_auth(task: Task) -> dict | None:
    """The task's registry credentials with the password read from the tenant's secrets,
    for the agent only (None: no credentials, or the secret is gone)."""
    auth = task.registry_auth
    if not auth:
        return None
    password = read_secret(task.tenant, auth["password"]["secret"])
    if password is None:
        return None
    return {"registry": auth["registry"], "username": auth["username"], "password": password}


def task_event(task_id: int, *, kind: str, message: str, details: dict | None = None, node_id: str | None = None):
    """A TaskEvent not yet saved, shaped the one way (the message cut to its column)."""
    return TaskEvent(task_id=task_id, kind=kind, message=message[:2000], details=details or {}, node_id=node_id)


def record_event(task: Task, *, kind: str, message: str, details: dict | None = None, node_id: str | None = None):
    event = task_event(task.pk, kind=kind, message=message, details=details, node_id=node_id)
    event.task = task
    event.save(force_insert=True)
    return event


def record_events(events) -> list:
    """Many task_event()s in one INSERT (a sweep after a rack fails writes hundreds)."""
    return TaskEvent.objects.bulk_create(list(events))


# --- requeue (operators: the admin, node maintenance) ---------------------------------------

# A task not started yet goes straight back to the queue, its cards released. A starting
# or running one is stopped by its agent first, the way a preemption is: preempting, the
# agent confirms the stop and requeue_preempted queues it (the watchdog forces that after
# 60 s). Other states are left alone: pending is queued already, and the rest are ending,
# asleep or paused by someone on purpose.
REQUEUE_AT_ONCE = (S.SCHEDULED,)
REQUEUE_AFTER_STOP = (S.STARTING, S.RUNNING)


def requeue_tasks(task_ids, *, why: str) -> dict[str, list[int]]:
    """Send tasks back to the queue (see above). Returns the ids moved to pending and
    those asked to stop first (preempting); each gets a "requeued" event saying why."""
    ids = list(task_ids)
    with transaction.atomic():
        nodes = dict(Task.objects.filter(pk__in=ids).values_list("pk", "node_id"))
        queued = move_tasks(ids, REQUEUE_AT_ONCE, S.PENDING, node=None, host_port=None)
        stopping = move_tasks([pk for pk in ids if pk not in set(queued)], REQUEUE_AFTER_STOP, S.PREEMPTING)
        for pk in sorted([*queued, *stopping]):
            then = "back in the queue" if pk in queued else "its agent stops it, then it goes back to the queue"
            record_event(Task(pk=pk), kind="requeued", message=f"{why}: {then}", node_id=nodes.get(pk))
    return {"pending": sorted(queued), "preempting": sorted(stopping)}


def requeue_task(task: Task, *, why: str = "requeued by an operator") -> Task:
    """One task back to the queue; a task in no state to go back is a conflict."""
    moved = requeue_tasks([task.pk], why=why)
    task.refresh_from_db()
    if not (moved["pending"] or moved["preempting"]) and task.status not in (S.PENDING, S.PREEMPTING):
        raise Conflict(
            f"Task {task.pk} is {task.status}: only scheduled, starting and running tasks can be requeued.",
            "invalid_state",
        )
    return task
