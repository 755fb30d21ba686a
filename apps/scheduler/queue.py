"""What waits: the single tasks' batch after the queue cursor, the task groups' window,
whether a backlog remains, where the services' replicas run already; and a task or a
group as the queue would hand it to placement (pending_request, waiting_group)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
from django.db import connection

from apps.scheduler.core import (
    GroupReq,
    TaskReq,
    constraints,
)
from apps.tasks.choices import HOLDING, TERMINAL, GroupPlacement
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task, TaskGroup

BATCH_SIZE = 200
GROUP_BATCH_SIZE = 20  # pending task groups considered per cycle, in queue order


# The single tasks' queue: tasks outside any group, and the replicas of inference services
# (members of a group placed "replicas", each on its own like a single task; the gang
# groups' members are placed whole, by group_window). The replicas' groups are one hashed
# look-up per statement (a partial index holds them), so the common case, a task outside
# any group, costs what it did.
SINGLE_SQL = "(group_id IS NULL OR group_id IN (SELECT id FROM task_groups WHERE placement = 'replicas'))"
QUEUE_SQL = f"""
    SELECT id, tenant_id, gpu_required, gpu_memory_mb, gpu_type, priority, labels, kind, created_at, group_id,
           runtime, affinity, anti_affinity, max_duration_seconds
    FROM tasks WHERE status = 'pending' AND {SINGLE_SQL} {{after}}
    ORDER BY priority DESC, created_at, id LIMIT %s
"""
AFTER_CURSOR = "AND (priority < %s OR (priority = %s AND (created_at, id) > (%s, %s)))"
MOVE_CURSOR = (
    "\n"
    "    INSERT INTO scheduler_queue_cursor (id, priority, created_at, task_id) VALUES (1, %s, %s, %s)\n"
    "    ON CONFLICT (id) DO UPDATE SET priority = EXCLUDED.priority, created_at = EXCLUDED.created_at, "
    "task_id = EXCLUDED.task_id\n"
)


def next_batch(size: int = BATCH_SIZE) -> list[TaskReq]:
    """The next `size` pending single tasks (outside any group, or replicas of an
    inference service) in queue order after the cursor, wrapping around."""
    return [task for task, _ in next_batch_ordered(size)]


def next_batch_ordered(size: int = BATCH_SIZE) -> list[tuple[TaskReq, tuple]]:
    """next_batch, each task with its queue key (-priority, created_at, id)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT priority, created_at, task_id FROM scheduler_queue_cursor WHERE id = 1")
        mark = cursor.fetchone()
        rows = []
        if mark and mark[2] is not None:
            priority, created_at, task_id = mark
            cursor.execute(QUEUE_SQL.format(after=AFTER_CURSOR), [priority, priority, created_at, task_id, size])
            rows = cursor.fetchall()
        if len(rows) < size:
            seen = {row[0] for row in rows}
            cursor.execute(QUEUE_SQL.format(after=""), [size - len(rows)])
            rows += [row for row in cursor.fetchall() if row[0] not in seen]
        if rows:
            last = rows[-1]
            cursor.execute(MOVE_CURSOR, [last[5], last[8], last[0]])
    # decided in queue order even when the batch wrapped around the cursor
    rows.sort(key=lambda row: (-row[5], row[8], row[0]))
    # row: QUEUE_SQL's columns; created_at (row[8]) orders, it is not the request's
    return [(task_request(*row[:8], *row[9:]), (-row[5], row[8], row[0])) for row in rows]


def task_request(
    task_id,
    tenant_id,
    gpus,
    memory,
    gpu_type,
    priority,
    labels,
    kind,
    group_id,
    runtime,
    affinity,
    anti_affinity,
    max_duration,
) -> TaskReq:
    """A pending single task as placement sees it, from its columns as the cursor gives
    them (QUEUE_SQL's, and the predictions' reading)."""
    return TaskReq(
        id=task_id,
        tenant_id=tenant_id,
        gpu_required=gpus,
        gpu_memory_mb=memory,
        gpu_type=gpu_type,
        priority=priority,
        labels=jsonb(labels),
        kind=kind,
        replica_of=group_id,
        **constraints(runtime, jsonb(affinity), jsonb(anti_affinity)),
        max_duration=max_duration,
    )


def group_request(
    group_id,
    tenant_id,
    members,
    per_worker,
    gpu_type,
    strategy,
    priority,
    labels,
    kind,
    runtime,
    affinity,
    anti_affinity,
    max_duration,
) -> GroupReq:
    """A waiting gang as placement sees it, from WAITING_GROUPS_SQL's columns (and the
    predictions' reading of the same)."""
    return GroupReq(
        id=group_id,
        tenant_id=tenant_id,
        members=tuple(members),
        gpus_per_worker=per_worker,
        gpu_type=gpu_type,
        strategy=strategy,
        priority=priority,
        labels=jsonb(labels),
        kind=kind,
        **group_constraints(runtime, affinity, anti_affinity),
        max_duration=max_duration,
    )


def jsonb(value) -> dict:
    """A jsonb column as the cursor gives it (text), most often the empty object."""
    if not value or value == "{}":
        return {}
    return orjson.loads(value) if isinstance(value, (str, bytes)) else value


# Where the services' replicas already hold a node (for the replica-spread score).
REPLICAS_ON_NODES = """
    SELECT group_id, node_id, count(*) FROM tasks
    WHERE group_id = ANY(%s) AND node_id IS NOT NULL AND status = ANY(%s)
    GROUP BY group_id, node_id
"""


def replicas_on_nodes(batch: Sequence[TaskReq]) -> dict[int, dict[str, int]]:
    """For the services with a replica in `batch`: how many of their replicas each node
    holds now (group id -> node id -> count). No query when the batch has no replica."""
    services = sorted({task.replica_of for task in batch if task.replica_of is not None})
    if not services:
        return {}
    on: dict[int, dict[str, int]] = {service: {} for service in services}
    with connection.cursor() as cursor:
        cursor.execute(REPLICAS_ON_NODES, [services, list(HOLDING)])
        for group_id, node_id, count in cursor.fetchall():
            on[group_id][node_id] = count
    return on


# Whether more single tasks wait than the batch took (the backlog: another cycle at once),
# and whether any group member waits at all or a group still has a reservation report to
# clear (else the groups' statement is not run): one
# statement that reads at most batch + 1 queue entries, where counting would read them all.
QUEUE_STATE = f"""
    SELECT EXISTS (SELECT 1 FROM tasks WHERE status = 'pending' AND {SINGLE_SQL} OFFSET %s),
           EXISTS (
               SELECT 1 FROM tasks t JOIN task_groups g ON g.id = t.group_id
               WHERE t.status = 'pending' AND t.group_id IS NOT NULL AND g.placement = 'gang'
           )
           OR EXISTS (SELECT 1 FROM task_groups WHERE NOT (reservation = '{{}}'::jsonb))
"""


def queue_state(batch_size: int) -> tuple[bool, bool]:
    """(more single tasks pending than `batch_size`, a gang group to look at)."""
    with connection.cursor() as cursor:
        cursor.execute(QUEUE_STATE, [batch_size])
        backlog, groups_waiting = cursor.fetchone()
    return backlog, groups_waiting


# One statement per cycle for the task groups placed as a gang (a replicas group's members
# are single tasks, in the queue above). The groups whose current members (those
# not ended) are all pending, every rank there (`waiting`); of them, the head of each
# priority (the first in queue order whose last explanation does not say that its type's
# nodes in the tenant's reach could never take it: such a group would hold the head's
# place and starve the ones behind it), and the window: the next `size` after the cursor
# (row 2 of scheduler_queue_cursor, whose task_id is the last group's id), wrapping round
# to the start of the queue. The cursor moves to where the window ends (`moved`), and a
# group that is not a head any more (bound, stopped, ended, overtaken) loses its
# reservation report (`cleared`; a head's report is rewritten after the cycle's decision,
# and bind clears the one it binds). A row another scheduler is clearing is skipped, not
# waited for.
WAITING_GROUPS_SQL = """
    WITH waiting AS (
        SELECT g.id, g.tenant_id, g.gpus_per_worker, g.gpu_type, g.strategy, g.priority, g.labels, g.kind,
               g.created_at, array_agg(t.id ORDER BY t.rank) AS members, g.reservation,
               g.runtime, g.affinity, g.anti_affinity,
               CASE WHEN bool_and(t.max_duration_seconds IS NOT NULL) THEN max(t.max_duration_seconds) END
                   AS max_duration,
               coalesce((g.schedule_reason->'workers'->>'reach')::int, g.world_size) >= g.world_size AS in_reach
        FROM task_groups g JOIN tasks t ON t.group_id = g.id AND NOT (t.status = ANY(%(ended)s))
        WHERE g.placement = 'gang'
          AND g.id IN (SELECT group_id FROM tasks WHERE status = 'pending' AND group_id IS NOT NULL)
        GROUP BY g.id
        HAVING bool_and(t.status = 'pending') AND count(*) = g.world_size
    ),
    heads AS (
        SELECT DISTINCT ON (priority) id FROM waiting WHERE in_reach ORDER BY priority DESC, created_at, id
    ),
    mark AS (SELECT priority, created_at, task_id FROM scheduler_queue_cursor WHERE id = %(row)s),
    after_cursor AS (
        SELECT w.id FROM waiting w LEFT JOIN mark m ON true
        WHERE m.priority IS NULL OR w.priority < m.priority
           OR (w.priority = m.priority AND (w.created_at, w.id) > (m.created_at, m.task_id))
        ORDER BY w.priority DESC, w.created_at, w.id LIMIT %(size)s
    ),
    wrapped AS (
        SELECT id FROM waiting WHERE id NOT IN (SELECT id FROM after_cursor)
        ORDER BY priority DESC, created_at, id LIMIT greatest(%(size)s - (SELECT count(*) FROM after_cursor), 0)
    ),
    moved AS (
        INSERT INTO scheduler_queue_cursor (id, priority, created_at, task_id)
        SELECT %(row)s, w.priority, w.created_at, w.id
        FROM waiting w JOIN (SELECT id, 0 AS lap FROM after_cursor UNION ALL SELECT id, 1 FROM wrapped) taken USING (id)
        ORDER BY taken.lap DESC, w.priority, w.created_at DESC, w.id DESC LIMIT 1
        ON CONFLICT (id) DO UPDATE
        SET priority = EXCLUDED.priority, created_at = EXCLUDED.created_at, task_id = EXCLUDED.task_id
    ),
    cleared AS (
        UPDATE task_groups SET reservation = '{}'
        WHERE id IN (
            SELECT id FROM task_groups WHERE reservation <> '{}' AND id NOT IN (SELECT id FROM heads)
            ORDER BY id FOR UPDATE SKIP LOCKED
        )
    )
    SELECT w.id, w.tenant_id, w.gpus_per_worker, w.gpu_type, w.strategy, w.priority, w.labels, w.kind, w.created_at,
           w.members, w.reservation, w.id IN (SELECT id FROM heads), w.runtime, w.affinity, w.anti_affinity,
           w.max_duration
    FROM waiting w
    WHERE w.id IN (SELECT id FROM heads) OR w.id IN (SELECT id FROM after_cursor) OR w.id IN (SELECT id FROM wrapped)
"""
GROUP_CURSOR_ROW = 2  # scheduler_queue_cursor's row for the group window (row 1: the single tasks' batch)


@dataclass
class GroupWindow:
    """A cycle's task groups: each with its queue key (-priority, created_at, rank 0's
    id), in queue order; and the heads of their priorities among them, each with the
    reservation report stored on it ({} when it has none yet)."""

    entries: list[tuple[GroupReq, tuple]] = field(default_factory=list)
    heads: dict[int, dict] = field(default_factory=dict)


def group_window(size: int = GROUP_BATCH_SIZE) -> GroupWindow:
    """The task groups a cycle decides: the head of every priority (always: it is the one
    that may reserve, and its wait is measured cycle by cycle), and `size` more in queue
    order after where the last window ended, wrapping round, so that groups that cannot
    be placed at the front of the queue never hide the ones behind them for good."""
    with connection.cursor() as cursor:
        cursor.execute(WAITING_GROUPS_SQL, {"ended": list(TERMINAL), "size": size, "row": GROUP_CURSOR_ROW})
        rows = cursor.fetchall()
    window = GroupWindow()
    for row in rows:
        gid, tenant_id, per_worker, gpu_type, strategy, prio, labels, kind, created, members, stored, head = row[:12]
        group = group_request(gid, tenant_id, members, per_worker, gpu_type, strategy, prio, labels, kind, *row[12:16])
        window.entries.append((group, (-prio, created, members[0])))
        if head:
            window.heads[gid] = jsonb(stored)
    window.entries.sort(key=lambda entry: entry[1])
    return window


def pending_request(task: Task) -> TaskReq | None:
    """A single task as placement would see it, while it waits in the queue (pending,
    not a gang member); None otherwise."""
    if task.status != S.PENDING or (task.group_id is not None and task.group.placement != GroupPlacement.REPLICAS):
        return None
    return TaskReq(
        id=task.pk,
        tenant_id=task.tenant_id,
        gpu_required=task.gpu_required,
        gpu_memory_mb=task.gpu_memory_mb,
        gpu_type=task.gpu_type,
        priority=task.priority,
        labels=task.labels or {},
        kind=task.kind,
        replica_of=task.group_id,
        **constraints(task.runtime, task.affinity, task.anti_affinity),
        max_duration=task.max_duration_seconds,
    )


def waiting_group(group: TaskGroup) -> GroupReq | None:
    """The group as placement would see it, if it is waiting to be placed (every current
    member pending, every rank there); None otherwise (bound, running, ending), and for a
    replicas group (its members are placed one by one, never as a group)."""
    if group.placement == GroupPlacement.REPLICAS:
        return None
    current = list(
        group.tasks.exclude(status__in=TERMINAL).order_by("rank").values_list("pk", "status", "max_duration_seconds")
    )
    if len(current) != group.world_size or any(status != S.PENDING for _, status, _ in current):
        return None
    durations = [duration for _, _, duration in current]
    return GroupReq(
        id=group.pk,
        tenant_id=group.tenant_id,
        members=tuple(pk for pk, _, _ in current),
        gpus_per_worker=group.gpus_per_worker,
        gpu_type=group.gpu_type,
        strategy=group.strategy,
        priority=group.priority,
        labels=group.labels or {},
        kind=group.kind,
        **group_constraints(group.runtime, group.affinity, group.anti_affinity),
        max_duration=None if None in durations else max(durations),
    )


def group_constraints(runtime: str, affinity, anti_affinity) -> dict:
    """GroupReq's constraint fields (a task's, less `same_service`: a gang's workers are
    placed together, not kept apart)."""
    found = constraints(runtime, jsonb(affinity), jsonb(anti_affinity))
    del found["same_service_apart"]
    return found
