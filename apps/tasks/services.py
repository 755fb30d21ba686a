"""Every state change of tasks. Status moves only through move_tasks(): the CAS
(apps.core.cas.transition) plus what follows from a move, in the same transaction."""

from __future__ import annotations

import logging
import secrets
import time
from enum import StrEnum
from typing import NamedTuple

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
from apps.core.error_codes import CoreErrorCode
from apps.core.errors import Conflict
from apps.scheduler.ledger import TASK_ENERGY, release
from apps.scheduler.models import GpuAllocation
from apps.slices.ledger import release_for_tasks as release_slices
from apps.tasks import logs
from apps.tasks.choices import TERMINAL, TRANSITIONS, GroupPlacement, GroupStatus, TaskKind, group_status
from apps.tasks.choices import TaskStatus as S
from apps.tasks.error_codes import TaskErrorCode
from apps.tasks.models import Task, TaskEvent, TaskGroup, TenantUsage
from apps.tasks.selectors import is_memory_only, slice_confirmed
from apps.tenants.models import Tenant

logger = logging.getLogger(__name__)

# moves after which a task holds nothing on a node any more
OFF_NODE = frozenset(TERMINAL) | {S.PENDING}


def move_tasks(task_ids, from_statuses, to_status, *, following: frozenset[int] = frozenset(), **changes) -> list[int]:
    """Move tasks by CAS and apply what follows, in one transaction: a run's GPU time is
    counted when it ends (to the queue or for good), the cards and host port are given
    back, usage is settled once when the task ends, a failure raises TASK_FAILED, and a
    group member's loss is followed for its group (follow_group_losses; not for the
    groups in `following`, whose loss the caller is following). Returns the ids that won;
    a loser changes nothing."""
    return _move_tasks(task_ids, from_statuses, to_status, TRANSITIONS, changes, following)


def _move_tasks(task_ids, from_statuses, to_status, table, changes, following=frozenset()) -> list[int]:
    """move_tasks under the allowed-transition `table` (TRANSITIONS, or REPLICA_TRANSITIONS
    for requeue_replicas alone)."""
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
        # a member of a task group leaving for the queue or failing ends its group's
        # attempt: the groups are locked before the members (see follow_group_losses)
        members = lock_groups_of(ids) if to_status in GROUP_FOLLOWED else []
        won = transition(Task, table, ids, from_statuses, to_status, **changes)
        if won and to_status in OFF_NODE:
            logs.announce_moves(won, to_status)  # the run's end, to its log's followers
            _count_gpu_time(won, now)
            _count_energy(won)
            release(won)
            release_slices(won, now)
            if to_status in TERMINAL:
                _settle_usage(won, now)
            if to_status == S.FAILED:
                _alert_failures(won)
        if won and members:
            follow_group_losses([member for member in members if member.pk in set(won)], to_status, following=following)
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


def _count_energy(task_ids) -> None:
    """What the cards grew while the tasks held them (apps.scheduler.ledger.TASK_ENERGY),
    added to the tasks' energy, with its carbon under each node's factor now and the
    energy no factor covered apart (docs/energy.md#tasks). A task none of whose cards
    measured power keeps its energy null: unknown, not 0. Before release(), which
    deletes the rows the growth is read from."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""UPDATE tasks AS t SET energy_wh = COALESCE(t.energy_wh, 0) + e.wh,
                   carbon_g = CASE WHEN e.carbon_g IS NULL THEN t.carbon_g
                                   ELSE COALESCE(t.carbon_g, 0) + e.carbon_g END,
                   energy_wh_unfactored = t.energy_wh_unfactored + e.unfactored_wh
               FROM ({TASK_ENERGY}) AS e
               WHERE t.id = e.task_id AND e.wh IS NOT NULL""",
            {"tasks": list(task_ids)},
        )


def _settle_usage(task_ids, now) -> None:
    """Once per end of a task: the unique task_id makes a second settlement of the same
    end a no-op. An inference replica's slot requeued after it ended (requeue_replicas)
    ends again with more GPU seconds: its record then carries the new total. The record
    carries the task's energy, carbon and unfactored energy as _count_energy left them."""
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO usage_records (task_id, tenant_id, gpus, gpu_seconds, energy_wh, carbon_g,
                                         energy_wh_unfactored, ended_status, settled_at)
               SELECT id, tenant_id, gpu_required, gpu_seconds, energy_wh, carbon_g, energy_wh_unfactored,
                      status, %s FROM tasks
               WHERE id = ANY(%s) AND status = ANY(%s)
               ON CONFLICT (task_id) DO UPDATE SET gpu_seconds = EXCLUDED.gpu_seconds,
                   energy_wh = EXCLUDED.energy_wh, carbon_g = EXCLUDED.carbon_g,
                   energy_wh_unfactored = EXCLUDED.energy_wh_unfactored,
                   ended_status = EXCLUDED.ended_status, settled_at = EXCLUDED.settled_at
               WHERE usage_records.gpu_seconds < EXCLUDED.gpu_seconds
                  OR COALESCE(usage_records.energy_wh, 0) < COALESCE(EXCLUDED.energy_wh, 0)""",
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


class Asked(NamedTuple):
    """What tasks about to be counted ask of their tenant's quota."""

    tasks: int
    gpus: int
    gpu_memory_mb: int  # per GPU asked for (at least one each), as the usage counter counts it


def asked(requests) -> Asked:
    """What tasks asking `requests` ((gpu_required, gpu_memory_mb) each) ask in all."""
    tasks = gpus = memory = 0
    for gpu_required, gpu_memory_mb in requests:
        tasks += 1
        gpus += gpu_required
        memory += (gpu_memory_mb or 0) * max(gpu_required, 1)
    return Asked(tasks, gpus, memory)


def quota_refusal(tenant, ask: Asked) -> str | None:
    """The quota check of every way into the counted set (create_tasks, requeue_replicas):
    the tenant's usage row locked (FOR UPDATE, until the transaction ends, so two
    concurrent asks cannot both pass a quota with room for one), then why `ask` would not
    fit (the Conflict's message), or None when it fits."""
    use = TenantUsage.objects.locked(tenant.pk).as_use()
    problems = quota_problems(tenant, use, tasks=ask.tasks, gpus=ask.gpus, gpu_memory_mb=ask.gpu_memory_mb)
    return f"Quota of tenant '{tenant.slug}' exceeded: {'; '.join(problems)}." if problems else None


def create_task(*, tenant, created_by=None, **fields) -> Task:
    """Queue one task (create_tasks with one spec)."""
    return create_tasks(tenant, [fields], created_by=created_by)[0]


INSERT_BATCH = 1000  # rows per INSERT statement of a batch
# a group member's hard placement constraints are its group's (an inference service's
# replicas, a training group's workers), unless its spec says otherwise
MEMBER_CONSTRAINTS = ("runtime", "affinity", "anti_affinity")


def with_group_constraints(spec: dict) -> dict:
    """The spec of a group's member with the group's runtime, affinity and anti-affinity
    where it names none."""
    group = spec.get("group")
    if group is None or all(name in spec for name in MEMBER_CONSTRAINTS):
        return spec
    return {**{name: getattr(group, name) for name in MEMBER_CONSTRAINTS}, **spec}


def create_tasks(tenant, specs, *, created_by=None, before_insert=None) -> list[Task]:
    """Queue tasks, all or none: `specs` are Task fields, one dict per task. The quota is
    checked once for them all against the tenant's usage row, locked (FOR UPDATE) for
    the check and the insert, so two concurrent creates cannot both pass a quota with
    room for one; the triggers on `tasks` add the new rows to that counter in the same
    transaction. The rows are built before the lock is taken, so the critical section
    is two statements: the lock and the (bulk) insert. Conflict (quota_exceeded) when
    they do not fit: nothing is created. `before_insert()`, if given, runs under the
    lock once the quota check has passed, just before the insert, in the same
    transaction (create_group writes the group row there, so a refused group writes
    nothing)."""
    tasks = [Task(tenant=tenant, created_by=created_by, **with_group_constraints(spec)) for spec in specs]
    if not tasks:
        return []
    for task in tasks:
        if task.kind == TaskKind.INTERACTIVE and not task.app_token:
            task.app_token = secrets.token_urlsafe(32)  # each its own: the app asks for it
    ask = asked((task.gpu_required, task.gpu_memory_mb) for task in tasks)
    with transaction.atomic():
        message = quota_refusal(tenant, ask)
        if message is None:
            if before_insert is not None:
                before_insert()
            insert_rows(tasks, batch_size=INSERT_BATCH)
            transaction.on_commit(ask_for_a_cycle)
            return tasks
    _alert_quota(tenant, message)
    raise Conflict(message, TaskErrorCode.QUOTA_EXCEEDED)


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


def stop_tasks(task_ids, *, following: frozenset[int] = frozenset()) -> list[int]:
    """The stop intent for several tasks at once (a group's members): the queued ones
    cancelled, the ones with a container moved to stopping. The ids that moved.
    `following`: as move_tasks'."""
    task_ids = list(task_ids)
    with transaction.atomic():
        cancelled = set(move_tasks(task_ids, CANCEL_FROM, S.CANCELLED, following=following))
        rest = [pk for pk in task_ids if pk not in cancelled]
        return sorted(cancelled) + move_tasks(rest, STOP_FROM, S.STOPPING, following=following)


def stop_task(task: Task) -> Task:
    with transaction.atomic():
        if not stop_tasks([task.pk]):
            task.refresh_from_db()
            if task.status not in TERMINAL and task.status != S.STOPPING:
                raise Conflict(
                    f"Task {task.pk} is {task.status} and cannot be stopped now.", CoreErrorCode.INVALID_STATE
                )
            # already ending: asking again is not an error
    task.refresh_from_db()
    return task


# --- task groups: submitting one, stopping one ------------------------------------------

# A group's own columns; the rest of a group spec (MEMBER_FIELDS) is its members'.
GROUP_FIELDS = frozenset(f.name for f in TaskGroup._meta.concrete_fields) - {"id", "tenant", "created_by"}
MEMBER_FIELDS = frozenset({"timeout_seconds", "max_duration_seconds"})


def member_name(group_name: str, rank: int) -> str:
    """`<group>-<rank>`, cut to the task name's column."""
    suffix = f"-{rank}"
    return group_name[: Task._meta.get_field("name").max_length - len(suffix)] + suffix


def create_group(tenant, spec: dict, *, created_by=None) -> TaskGroup:
    """Queue a task group: its row and its `world_size` members, ordinary training tasks
    of ranks 0…n-1 with `gpus_per_worker` cards of exactly `gpu_type` each and the
    group's image, command, env, volumes, checkpoint path, priority and labels (the
    agent resumes each from the checkpoint path as it does any task's). All or nothing:
    the members go through create_tasks, which checks the quota for the whole group at
    once under the tenant's lock and writes the group row there (before_insert), after
    the check passed; a group that does not fit is refused whole (Conflict
    quota_exceeded) and nothing is written. `spec` holds TaskGroup fields and,
    optionally, the members' `timeout_seconds` and `max_duration_seconds`."""
    unknown = set(spec) - GROUP_FIELDS - MEMBER_FIELDS
    if unknown:
        raise TypeError(f"not fields of a task group: {', '.join(sorted(unknown))}")
    group = TaskGroup(
        tenant=tenant, created_by=created_by, **{name: value for name, value in spec.items() if name in GROUP_FIELDS}
    )
    member = {
        "kind": TaskKind.TRAINING,
        "group": group,  # its id is set once before_insert has saved it
        "image": group.image,
        "command": group.command,
        "env": group.env,
        "volumes": group.volumes,
        "gpu_required": group.gpus_per_worker,
        "gpu_type": group.gpu_type,
        "priority": group.priority,
        "labels": group.labels,
        "checkpoint_path": group.checkpoint_path,
        "preemptible": False,
    }
    member |= {name: spec[name] for name in MEMBER_FIELDS if name in spec}
    specs = [{**member, "name": member_name(group.name, rank), "rank": rank} for rank in range(group.world_size)]
    create_tasks(tenant, specs, created_by=created_by, before_insert=group.save)
    return group


ENDED_GROUP = (GroupStatus.COMPLETED, GroupStatus.FAILED, GroupStatus.STOPPED)


def stop_group(group: TaskGroup) -> TaskGroup:
    """Stop every member of a group through the one stop intent (stop_tasks): the queued
    ones cancelled, the running ones asked to stop. Asking again while it stops is not
    an error; a group that has already ended is a Conflict (invalid_state), as a task is.
    Returns the group as it is now."""
    members = list(Task.objects.filter(group_id=group.pk).values_list("pk", flat=True))
    with transaction.atomic():
        if not stop_tasks(members):
            status = group_status(
                Task.objects.filter(group_id=group.pk).values_list("status", flat=True), group.placement
            )
            if status in ENDED_GROUP:
                raise Conflict(
                    f"Task group {group.pk} is {status} and cannot be stopped now.", CoreErrorCode.INVALID_STATE
                )
            if status != GroupStatus.STOPPING:
                raise Conflict(
                    f"Task group {group.pk} is {status}, its members in no state to be stopped now.",
                    CoreErrorCode.INVALID_STATE,
                )
            # already stopping: asking again is not an error
    return TaskGroup.objects.with_status().get(pk=group.pk)


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
# the agent's claim of a bound task: it is about to start it
CLAIMS = frozenset({S.RUNNING, S.STARTING})


def check_slice_confirmed(task: Task) -> None:
    """No limit, no start: a memory-only task is claimed only once its slice is
    confirmed (409 otherwise; the agent tries again on a later poll). A confirmed slice
    stays so while the task is scheduled (only the task's own move releases it), so the
    claim's CAS that follows cannot start it unlimited."""
    if is_memory_only(task) and not Task.objects.filter(pk=task.pk).filter(slice_confirmed(task.pk)).exists():
        raise Conflict(
            f"Task {task.pk} is memory-only and its slice is not confirmed yet; it may not start.",
            TaskErrorCode.SLICE_NOT_CONFIRMED,
        )


# the statuses in which a run ends on its own (the agent reports completed or failed)
RUN_STATUSES = (S.SCHEDULED, S.STARTING, S.RUNNING, S.WAKING)


def agent_report(
    task: Task, *, from_status: str, to_status: str, exit_code=None, error_message: str = "", log_tail: str = ""
) -> bool:
    """An agent's report, as a CAS from the status it saw. False: it lost (someone moved
    the task first, or the same report was already applied); nothing changed."""
    if to_status not in AGENT_MOVES.get(from_status, frozenset()):
        raise IllegalTransition(f"an agent cannot move a task from {from_status} to {to_status}")
    if from_status == S.SCHEDULED and to_status in CLAIMS:
        check_slice_confirmed(task)
    changes: dict = {}
    if to_status == S.RUNNING:
        changes["started_at"] = utcnow()
    if to_status in TERMINAL:
        changes.update(exit_code=exit_code, error_message=error_message[:10_000], log_tail=log_tail)
    if to_status == S.PENDING:  # a preempted task's stop is confirmed: back to the queue
        return bool(requeue_preempted([task.pk]))
    if in_gang(task):
        return report_group_member(task, from_status=from_status, to_status=to_status, changes=changes)
    return bool(move_tasks(task.pk, [from_status], to_status, **changes))


def in_gang(task: Task) -> bool:
    """Whether the task is a member of a gang group (a training job: its members live and
    fail together). A replica of an inference service (a group placed as `replicas`) is
    handled as a single task: its failure ends it alone, and the service's rebuild
    requeues it."""
    return task.group_id is not None and task.group.placement == GroupPlacement.GANG


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


def record_card_losses(node_id: str, cards: list[tuple[int, str]]) -> int:
    """A trace on every task holding one of the node's cards the heartbeat has just
    judged lost ((index, basis) pairs): one event each. What becomes of the tasks is the
    failure policy's (apps.alerts.failures). How many events."""
    basis = dict(cards)
    holders = GpuAllocation.objects.filter(node_id=node_id, gpu_index__in=list(basis)).order_by("task_id", "gpu_index")
    return len(
        record_events(
            task_event(
                task_id,
                kind="gpu_lost",
                message=f"GPU {index} of node {node_id}, which it holds, is lost ({basis[index]}).",
                details={"node_id": node_id, "gpu_index": index, "basis": basis[index]},
                node_id=node_id,
            )
            for task_id, index in holders.values_list("task_id", "gpu_index")
        )
    )


# --- inference replicas: a slot requeued ------------------------------------------------
#
# A replica of an inference service is a member of a `replicas` group, one task row per
# slot (rank) for good: the unique (group, rank) holds over every status. Rebuilding a
# replica that ended, waking a service that slept or scaling back up over a slot stopped
# before sends that same row back to the queue, a new attempt: the one move out of an
# ended status there is, allowed for these rows only (REPLICA_TRANSITIONS).

REPLICA_REQUEUE_FROM = (S.FAILED, S.STOPPED, S.CANCELLED, S.COMPLETED)
REPLICA_TRANSITIONS = {**TRANSITIONS, **{status: TRANSITIONS[status] | {S.PENDING} for status in REPLICA_REQUEUE_FROM}}


def requeue_replicas(task_ids, *, why: str, details: dict | None = None) -> list[int]:
    """Ended replica slots (members of a `replicas` group, in REPLICA_REQUEUE_FROM) back to
    the queue, all or none against the tenant's quota (quota_refusal, as create_tasks
    checks it; Conflict quota_exceeded: nothing moved). Each requeued slot
    gets a `replica_requeued` event saying why, with `details` (the inference rebuild
    marks the crash restarts there, its crash-loop history).
    Returns the ids that moved; one someone else moved first is left out."""
    rows = list(
        Task.objects.filter(
            pk__in=list(task_ids), group__placement=GroupPlacement.REPLICAS, status__in=REPLICA_REQUEUE_FROM
        ).values_list("pk", "tenant_id", "gpu_required", "gpu_memory_mb", "node_id")
    )
    if not rows:
        return []
    by_tenant: dict[int, list[tuple]] = {}
    for row in rows:
        by_tenant.setdefault(row[1], []).append(row)
    tenants = {tenant.pk: tenant for tenant in Tenant.objects.filter(pk__in=list(by_tenant))}
    with transaction.atomic():
        for tenant_id, tenant_rows in sorted(by_tenant.items()):
            message = quota_refusal(tenants[tenant_id], asked((row[2], row[3]) for row in tenant_rows))
            if message is not None:
                raise Conflict(message, TaskErrorCode.QUOTA_EXCEEDED)
        won = _move_tasks(
            [row[0] for row in rows],
            REPLICA_REQUEUE_FROM,
            S.PENDING,
            REPLICA_TRANSITIONS,
            {
                "node": None,
                "host_port": None,
                "exit_code": None,
                "error_message": "",
                "finished_at": None,
                "started_at": None,
            },
        )
        nodes = {row[0]: row[4] for row in rows}
        record_events(
            task_event(pk, kind="replica_requeued", message=why, details=details, node_id=nodes.get(pk)) for pk in won
        )
        if won:
            transaction.on_commit(ask_for_a_cycle)
    return won


# --- requeue (operators: the admin, node maintenance) ---------------------------------------

# A task not started yet goes straight back to the queue, its cards released. A starting
# or running one is stopped by its agent first, the way a preemption is: preempting, the
# agent confirms the stop and requeue_preempted queues it (the watchdog forces that after
# 60 s). Other states are left alone: pending is queued already, and the rest are ending,
# asleep or paused by someone on purpose.
REQUEUE_AT_ONCE = (S.SCHEDULED,)
REQUEUE_AFTER_STOP = (S.STARTING, S.RUNNING)


def requeue_tasks(task_ids, *, why: str, following: frozenset[int] = frozenset()) -> dict[str, list[int]]:
    """Send tasks back to the queue (see above). Returns the ids moved to pending and
    those asked to stop first (preempting); each gets a "requeued" event saying why.
    `following`: as move_tasks'."""
    ids = list(task_ids)
    with transaction.atomic():
        nodes = dict(Task.objects.filter(pk__in=ids).values_list("pk", "node_id"))
        queued = move_tasks(ids, REQUEUE_AT_ONCE, S.PENDING, following=following, node=None, host_port=None)
        rest = [pk for pk in ids if pk not in set(queued)]
        stopping = move_tasks(rest, REQUEUE_AFTER_STOP, S.PREEMPTING, following=following)
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
            CoreErrorCode.INVALID_STATE,
        )
    return task


# --- task groups: a lost worker ends the attempt of the whole group (docs/failures.md) -----
#
# A group's attempt is one placement of all its members (TaskGroup.attempts, counted at
# bind). A member moved to the queue (its node given up, its container lost, its run
# stalled, its run failed, an operator's requeue) or to failed ends the attempt for every
# member, once: every move to pending or failed locks the members' group rows before its
# own compare-and-set (lock_groups_of), so two members lost at once, in two transactions,
# queue on the group row; the first ends the attempt by a compare-and-set on that row
# (ended_attempt = attempts) and the second finds it ended. The first then
# - requeues the group whole: the other members go back to the queue the way
#   requeue_tasks sends any task back (not started: at once; started: its agent stops it
#   and confirms, or the preemption watchdog forces it after 60 s). The scheduler takes
#   only whole groups, so the group is placed again once every member is pending;
# - or fails it whole: when a member failed for good, when a member had completed (a
#   group runs again only whole), or when this was its last attempt
#   (HETEROFLOW_GROUP_MAX_ATTEMPTS). The pending members fail with the reason, the others
#   get the stop intent (stop_tasks).
# A group someone stopped (a member stopping, stopped or cancelled) is never requeued: a
# member lost meanwhile is cancelled, and a member whose stop is confirmed (stopped)
# takes the others with it (the stop intent). Whether a requeued group can be placed at all is the
# failure policy's to say (apps.alerts.failures.sweep_requeued_groups, the single tasks'
# capacity verdict).
# Which of these follows is group_loss_verdict's, from the loss's facts alone; each
# verdict has one applier (GROUP_LOSS_APPLIERS).

GROUP_LOSS_TARGETS = (S.PENDING, S.FAILED)
# moves of a member followed for its group: the losses, and a member's stop confirmed
GROUP_FOLLOWED = (*GROUP_LOSS_TARGETS, S.STOPPED)
STOPPED_ON_PURPOSE = frozenset({S.STOPPING, S.STOPPED, S.CANCELLED})
# members that end the hope of running the group again whole
NO_RERUN = STOPPED_ON_PURPOSE | {S.FAILED, S.COMPLETED}


class LeavingMember(NamedTuple):
    pk: int
    group_id: int
    rank: int
    node_id: str | None
    status: str


def lock_groups_of(task_ids) -> list[LeavingMember]:
    """The members of gang groups among `task_ids` as they are before a move, their
    groups' rows locked (in id order) until the transaction ends. Replicas of an
    inference service (a group placed as `replicas`) are not among them: one that dies
    or is lost ends alone, and its siblings go on serving."""
    members = [
        LeavingMember(*row)
        for row in Task.objects.filter(pk__in=task_ids, group__placement=GroupPlacement.GANG).values_list(
            "pk", "group_id", "rank", "node_id", "status"
        )
    ]
    if members:
        groups = TaskGroup.objects.select_for_update().filter(pk__in={m.group_id for m in members}).order_by("pk")
        list(groups.values_list("pk", flat=True))
    return members


class GroupLoss(StrEnum):
    """What follows for a group from members moved to pending, failed or stopped
    (group_loss_verdict; each has its applier in GROUP_LOSS_APPLIERS)."""

    STOP = "stop"  # a member's stop confirmed: the others get the stop intent
    JOIN_FAILURE = "join_failure"  # a member back from a stop to a group that failed: what is left fails
    CANCEL = "cancel"  # lost while the group was being stopped: cancelled, never placed again
    FAIL_AFTER_COMPLETION = "fail_after_completion"  # another rank completed: a group runs again only whole
    FAIL_LAST_ATTEMPT = "fail_last_attempt"  # HETEROFLOW_GROUP_MAX_ATTEMPTS reached
    FAIL = "fail"  # a member failed for good
    NOTHING = "nothing"  # its attempt was ended already: this member is one of the requeue
    REQUEUE = "requeue"  # the attempt ended now: the group goes back to the queue whole


class GroupLossFacts(NamedTuple):
    to_status: str  # where the members moved: pending, failed or stopped
    statuses: frozenset[str]  # every member's status, the moved ones' included
    ended_now: bool  # this loss ended the group's attempt (it won the compare-and-set on the group row)
    last_attempt: bool  # the group's attempts have reached HETEROFLOW_GROUP_MAX_ATTEMPTS


def group_loss_verdict(facts: GroupLossFacts) -> GroupLoss:
    """What follows from a loss (see above), from the facts alone."""
    if facts.to_status == S.STOPPED:
        return GroupLoss.STOP
    if facts.to_status != S.FAILED and S.FAILED in facts.statuses:
        return GroupLoss.JOIN_FAILURE
    if facts.to_status != S.FAILED and facts.statuses & STOPPED_ON_PURPOSE:
        return GroupLoss.CANCEL
    if S.COMPLETED in facts.statuses:
        return GroupLoss.FAIL_AFTER_COMPLETION
    if facts.last_attempt and (facts.to_status == S.FAILED or facts.ended_now):
        return GroupLoss.FAIL_LAST_ATTEMPT
    if facts.to_status == S.FAILED:
        return GroupLoss.FAIL
    return GroupLoss.REQUEUE if facts.ended_now else GroupLoss.NOTHING


def follow_group_losses(moved: list[LeavingMember], to_status: str, *, following: frozenset[int] = frozenset()) -> None:
    """What follows from members moved to pending, failed or stopped (see above), group by
    group. `following`: the groups whose loss the caller is following already; the moves
    that following makes of their members come back here and are left alone."""
    by_group: dict[int, list[LeavingMember]] = {}
    for member in moved:
        by_group.setdefault(member.group_id, []).append(member)
    for group_id, lost in sorted(by_group.items()):
        if group_id in following:
            continue
        group = TaskGroup.objects.get(pk=group_id)
        facts = _group_loss_facts(group, to_status)
        GROUP_LOSS_APPLIERS[group_loss_verdict(facts)](_Loss(group, lost, to_status, following | {group_id}))


def _group_loss_facts(group: TaskGroup, to_status: str) -> GroupLossFacts:
    """The facts of a loss, under the group's lock: its members' statuses, and whether
    this loss ends its attempt (the compare-and-set ended_attempt = attempts, once)."""
    statuses = frozenset(Task.objects.filter(group=group).values_list("status", flat=True))
    ended_now = bool(
        TaskGroup.objects.filter(pk=group.pk, ended_attempt__lt=F("attempts")).update(
            ended_attempt=F("attempts"), updated_at=utcnow()
        )
    )
    return GroupLossFacts(to_status, statuses, ended_now, group.attempts >= settings.HETEROFLOW_GROUP_MAX_ATTEMPTS)


class _Loss(NamedTuple):
    """A loss as its applier gets it."""

    group: TaskGroup
    lost: list[LeavingMember]
    to_status: str
    following: frozenset[int]  # this group's included: its members' moves are not followed again

    @property
    def who(self) -> str:
        return ", ".join(f"rank {m.rank}" + (f" on node {m.node_id}" if m.node_id else "") for m in self.lost)

    @property
    def cause(self) -> str:
        attempt = f"attempt {self.group.attempts}: " if self.group.attempts else ""
        return f"{attempt}{self.who} {'failed' if self.to_status == S.FAILED else 'was lost'}"


def _stop_the_group(loss: _Loss) -> None:
    # one member stopped (its own stop, an eviction): the others cannot go on without it
    live = Task.objects.filter(group=loss.group).exclude(status__in=(*TERMINAL, S.PENDING)).values_list("pk", flat=True)
    stopped = stop_tasks(list(live), following=loss.following)
    _group_events(loss.group, stopped, "group_stopped", f"{loss.who} was stopped: the group stops with it")


def _join_the_failure(loss: _Loss) -> None:
    fail_group(loss.group, "the group has failed")


def _cancel_the_lost(loss: _Loss) -> None:
    cancelled = move_tasks([m.pk for m in loss.lost], [S.PENDING], S.CANCELLED, following=loss.following)
    _group_events(loss.group, cancelled, "group_stopped", f"{loss.cause} while the group was being stopped: cancelled")


def _fail_after_completion(loss: _Loss) -> None:
    _fail_with_the_lost(loss, " after another rank had completed; a group runs again only whole")


def _fail_last_attempt(loss: _Loss) -> None:
    limit = settings.HETEROFLOW_GROUP_MAX_ATTEMPTS
    _fail_with_the_lost(loss, f", the last attempt allowed (HETEROFLOW_GROUP_MAX_ATTEMPTS = {limit})")


def _fail(loss: _Loss) -> None:
    _fail_with_the_lost(loss, "")


def _fail_with_the_lost(loss: _Loss, why: str) -> None:
    fail_group(loss.group, loss.cause + why, lost=[m.pk for m in loss.lost])


def _nothing(loss: _Loss) -> None:
    pass


def _requeue_the_group(loss: _Loss) -> None:
    group, cause, limit = loss.group, loss.cause, settings.HETEROFLOW_GROUP_MAX_ATTEMPTS
    others = Task.objects.filter(group=group, status__in=(*REQUEUE_AT_ONCE, *REQUEUE_AFTER_STOP))
    requeue_tasks(
        list(others.values_list("pk", flat=True)),
        why=f"task group {group.name}: {cause}, the attempt ended",
        following=loss.following,
    )
    members = list(Task.objects.filter(group=group).values_list("pk", flat=True))
    _group_events(
        group,
        members,
        "group_requeued",
        f"{cause}: the attempt ended and the group is requeued whole "
        f"(attempt {group.attempts + 1} of at most {limit} once it is placed)",
    )


GROUP_LOSS_APPLIERS = {
    GroupLoss.STOP: _stop_the_group,
    GroupLoss.JOIN_FAILURE: _join_the_failure,
    GroupLoss.CANCEL: _cancel_the_lost,
    GroupLoss.FAIL_AFTER_COMPLETION: _fail_after_completion,
    GroupLoss.FAIL_LAST_ATTEMPT: _fail_last_attempt,
    GroupLoss.FAIL: _fail,
    GroupLoss.NOTHING: _nothing,
    GroupLoss.REQUEUE: _requeue_the_group,
}


def fail_group(group: TaskGroup, reason: str, *, lost=()) -> list[int]:
    """End a group whole as failed: its pending members fail with `reason`, the others
    get the stop intent (stop_tasks); each of them and the `lost` members (already moved)
    gets a group_failed event saying why. Returns the members moved. These moves of its
    members are not followed as losses of the group (it is ending whole)."""
    following = frozenset({group.pk})
    with transaction.atomic():
        message = f"task group {group.name} failed: {reason}"
        members = Task.objects.filter(group=group)
        failed = move_tasks(
            list(members.filter(status=S.PENDING).values_list("pk", flat=True)),
            [S.PENDING],
            S.FAILED,
            following=following,
            error_message=message,
        )
        live = members.exclude(status__in=(*TERMINAL, S.PENDING)).values_list("pk", flat=True)
        stopped = stop_tasks(list(live), following=following)
        moved = sorted([*failed, *stopped])
        _group_events(group, sorted({*moved, *lost}), "group_failed", message)
    return moved


def _group_events(group: TaskGroup, task_ids, kind: str, message: str) -> None:
    record_events(task_event(pk, kind=kind, message=message, details={"group_id": group.pk}) for pk in task_ids)


def group_may_run_again(group: TaskGroup) -> bool:
    """Whether a lost member would end the group's attempt in a whole requeue: an attempt
    under way, not its last, and no member failed, completed or stopped on purpose."""
    return (
        group.ended_attempt < group.attempts < settings.HETEROFLOW_GROUP_MAX_ATTEMPTS
        and not Task.objects.filter(group=group, status__in=NO_RERUN).exists()
    )


def report_group_member(task: Task, *, from_status: str, to_status: str, changes: dict) -> bool:
    """An agent's report on a member of a task group (agent_report), under the group's
    lock. A failed run, while the group may run again, goes back to the queue instead of
    failing: that ends the attempt and requeues the group whole (the exit is kept in the
    member's history). A run that ended on its own (completed or failed) after the server
    began ending the attempt (the member already stopping or preempting on that node)
    confirms that end. Otherwise the plain compare-and-set."""
    with transaction.atomic():
        group = TaskGroup.objects.select_for_update().get(pk=task.group_id)
        if to_status == S.FAILED and from_status in RUN_STATUSES and group_may_run_again(group):
            if move_tasks(task.pk, [from_status], S.PENDING, node=None, host_port=None):
                exit_code, error = changes.get("exit_code"), changes.get("error_message", "")
                message = f"its run failed on node {task.node_id}" + (f" ({error[:300]})" if error else "")
                record_event(
                    task,
                    kind="worker_failed_pending",
                    node_id=task.node_id,
                    message=f"{message}: attempt {group.attempts} of task group {group.name} ends, "
                    "back to the queue with the whole group",
                    details={"exit_code": exit_code, "error_message": error[:2000], "attempt": group.attempts},
                )
                raise_alerts(
                    [
                        NewAlert(
                            type=AlertType.TASK_REQUEUED,
                            severity=Severity.WARNING,
                            scope=AlertScope.TASK,
                            key=alert_keys.task_requeued(task.pk, utcnow()),
                            message=f"Task {task.name} ({task.pk}) requeued with group {group.name}: {message}.",
                            node_id=task.node_id or "",
                            task_id=task.pk,
                            tenant_id=task.tenant_id,
                            details={"cause": message, "group_id": group.pk, "attempt": group.attempts},
                        )
                    ]
                )
                return True
        elif move_tasks(task.pk, [from_status], to_status, **changes):
            return True
        if to_status not in (S.COMPLETED, S.FAILED) or from_status not in RUN_STATUSES or task.node_id is None:
            return False
        now = Task.objects.filter(pk=task.pk, node_id=task.node_id).values_list("status", flat=True).first()
        if now == S.PREEMPTING:
            return bool(requeue_preempted([task.pk]))
        if now == S.STOPPING:
            ended = {name: changes[name] for name in ("exit_code", "error_message", "log_tail") if name in changes}
            return bool(move_tasks(task.pk, [S.STOPPING], S.STOPPED, **ended))
        return False


def late_group_report(task: Task, node_id: str, *, attempt: int | None = None, lost: bool = False) -> str:
    """Why an agent's report on a group member is about an attempt that has ended ("" if
    it is not): it names another `attempt` than the group's (the agent echoes the one it
    was handed), the member is placed on another node now, or (`lost`: its
    compare-and-set lost) it is back in the queue, off its node. Such a report is refused
    (409 attempt_ended) and never moves the member of a later attempt. A replica of an
    inference service has no attempts (it answers as a single task does)."""
    if not in_gang(task):
        return ""
    where = f"Task {task.pk} (rank {task.rank} of task group {task.group_id})"
    current = task.group.attempts
    if attempt is not None and attempt != current:
        return f"{where} is in attempt {current} now: this report is about attempt {attempt}; nothing changed."
    if task.node_id is not None and task.node_id != node_id:
        return (
            f"{where} is {task.status} on node {task.node_id} now: this report from node {node_id} is about "
            "an attempt that has ended; nothing changed."
        )
    if lost and task.node_id is None:
        return f"{where} is back in the queue with its group: this report is about an ended attempt; nothing changed."
    return ""
