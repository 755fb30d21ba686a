"""The scheduler's shell: load a snapshot in a few queries, let the pure core decide,
bind the cycle's decisions in one transaction (nodes locked, cards re-checked against
the live ledger, one multi-row CAS pending → scheduled, ledger rows; each task group in
a savepoint of its own, all its members or none), and record why the other tasks and
groups did not fit."""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from itertools import combinations
from operator import attrgetter

import orjson
from django.conf import settings as django_settings
from django.db import connection, transaction
from django.db.models import F, Q
from psycopg.types.json import Jsonb
from rest_framework.exceptions import ValidationError

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.services import raise_alert
from apps.core.cas import check_transition, compare_and_set
from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.monitoring import metrics
from apps.nodes import liveness
from apps.nodes.models import Gpu, Node
from apps.nodes.network import same_network_domain
from apps.scheduler.core import (
    PREEMPT_STAGES,
    SCHEDULABLE_STATUSES,
    VICTIM_STATUSES,
    Decision,
    Failure,
    GpuSnap,
    GroupDecision,
    GroupFailure,
    GroupReq,
    Held,
    NodeSnap,
    Occupant,
    PluginSettings,
    PreemptionPlan,
    TaskReq,
    memory_detail,
    occupants_by_node,
    place_queue,
    plan_preemption,
)
from apps.scheduler.error_codes import SchedulerErrorCode
from apps.scheduler.ledger import ALLOCATE
from apps.scheduler.models import GpuAllocation, PluginConfig
from apps.slices import ledger as slice_ledger
from apps.slices.choices import LIVE as LIVE_SLICES
from apps.slices.choices import SliceState
from apps.slices.planning import Refusal, mig_model
from apps.slices.planning import occupancy as slice_occupancy
from apps.tasks.choices import HOLDING, TERMINAL, TRANSITIONS, GroupPlacement, TaskKind
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task, TaskGroup
from apps.tasks.ranks import network_decision
from apps.tasks.services import move_tasks, requeue_preempted
from apps.tenants.models import TenantGroup

BATCH_SIZE = 200
GROUP_BATCH_SIZE = 20  # pending task groups considered per cycle, in queue order


# --- configuration ----------------------------------------------------------------------


@dataclass(frozen=True)
class PluginSpec:
    name: str
    kind: str  # "filter", "score" or "postfilter" (after a failed placement)
    default_enabled: bool
    locked: bool = False  # correctness plugins: always on
    exclusive_with: str = ""
    default_weight: float = 1.0
    default_extra: dict = field(default_factory=dict)


# The plugins the scheduler runs, in pipeline order.
PLUGINS: dict[str, PluginSpec] = {
    spec.name: spec
    for spec in (
        PluginSpec("gpu-filter", "filter", True, locked=True),
        PluginSpec("resource-filter", "filter", True, locked=True),
        PluginSpec("spread", "score", True, exclusive_with="binpack"),
        PluginSpec("binpack", "score", False, exclusive_with="spread"),
        PluginSpec("topology", "score", True),
        PluginSpec("rdma", "score", True),
        PluginSpec("nvlink", "score", True),
        # an inference service's replicas prefer nodes without another replica of it
        PluginSpec("replica-spread", "score", True),
        PluginSpec("preempt", "postfilter", True, default_weight=0.0, default_extra={"preempt_stage": "running"}),
    )
}


def plugin_table() -> list[dict]:
    """The effective configuration: stored rows over defaults. The scheduler reads this
    very function every cycle, so the API can never show a set it does not use."""
    stored = {config.name: config for config in PluginConfig.objects.filter(name__in=PLUGINS)}
    table = []
    for name, spec in PLUGINS.items():
        config = stored.get(name)
        enabled = True if spec.locked else (config.enabled if config else spec.default_enabled)
        table.append(
            {
                "name": name,
                "kind": spec.kind,
                "enabled": enabled,
                "locked": spec.locked,
                "weight": config.weight if config else spec.default_weight,
                "extra": spec.default_extra | (config.extra if config else {}),
            }
        )
    return table


def plugin_settings() -> PluginSettings:
    table = {row["name"]: row for row in plugin_table()}
    layout = "binpack" if table["binpack"]["enabled"] else "spread"
    scores = ("topology", "rdma", "nvlink", "replica-spread")
    enabled = frozenset(name for name in scores if table[name]["enabled"])
    weights = {name: table[name]["weight"] for name in ("spread", "binpack", *scores)}
    thresholds = {
        option: float(value)
        for option, value in table["resource-filter"]["extra"].items()
        if option in THRESHOLD_FIELDS and isinstance(value, (int, float))
    }
    preempt = table["preempt"]
    stage = preempt["extra"].get("preempt_stage", "running") if preempt["enabled"] else "disabled"
    return PluginSettings(layout=layout, weights=weights, enabled=enabled, preempt_stage=stage, **thresholds)


# Load thresholds, configurable as the resource-filter plugin's `extra`.
THRESHOLD_FIELDS = (
    "cpu_percent_max",
    "memory_percent_max",
    "gpu_memory_percent_max",
    "gpu_utilization_max",
    "gpu_temperature_max",
)


def set_plugin_enabled(name: str, enabled: bool) -> None:
    """Enable or disable a plugin. The layout plugins are exclusive: enabling one
    disables the other, and disabling one enables the other (there is always a layout)."""
    spec = PLUGINS[name]
    if spec.locked:
        raise Conflict(
            f"'{name}' keeps the scheduler correct and cannot be disabled or enabled.", SchedulerErrorCode.PLUGIN_LOCKED
        )
    with transaction.atomic():
        PluginConfig.objects.update_or_create(name=name, defaults={"enabled": enabled})
        if spec.exclusive_with:
            PluginConfig.objects.update_or_create(name=spec.exclusive_with, defaults={"enabled": not enabled})


# What each plugin's `extra` may hold: name -> check of the value (an error message or "")
def _percent(value) -> str:
    return (
        ""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 100
        else "a number from 0 to 100"
    )


def _temperature(value) -> str:
    return (
        ""
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 150
        else "degrees Celsius, 0 to 150"
    )


EXTRA_OPTIONS: dict[str, dict] = {
    "resource-filter": {
        "cpu_percent_max": _percent,
        "memory_percent_max": _percent,
        "gpu_memory_percent_max": _percent,
        "gpu_utilization_max": _percent,
        "gpu_temperature_max": _temperature,
    },
    "preempt": {
        "preempt_stage": lambda value: "" if value in PREEMPT_STAGES else f"one of {', '.join(PREEMPT_STAGES)}"
    },
}


def checked_extra(name: str, extra: dict) -> dict:
    """`extra` checked against what the plugin reads; a key set to null goes back to
    its default. Anything unknown or out of range is refused with nothing written."""
    options = EXTRA_OPTIONS.get(name, {})
    problems = {}
    for key, value in extra.items():
        if key not in options:
            problems[key] = [
                f"'{name}' has no option '{key}'" + (f"; it has {', '.join(options)}." if options else ".")
            ]
        elif value is not None and (problem := options[key](value)):
            problems[key] = [f"Must be {problem}."]
    if problems:
        raise ValidationError({"extra": problems})
    return extra


def set_plugin_options(name: str, *, weight: float | None = None, extra: dict | None = None) -> None:
    """Change a plugin's weight and `extra` (merged over what is stored)."""
    defaults = {}
    if weight is not None:
        defaults["weight"] = weight
    if extra is not None:
        checked_extra(name, extra)
        stored = PluginConfig.objects.filter(name=name).values_list("extra", flat=True).first() or {}
        defaults["extra"] = {key: value for key, value in (stored | extra).items() if value is not None}
    if defaults:
        row, created = PluginConfig.objects.get_or_create(
            name=name, defaults={"enabled": PLUGINS[name].default_enabled, **defaults}
        )
        if not created:
            for option, value in defaults.items():
                setattr(row, option, value)
            row.save()


def sharing_rule():
    """tenants_may_share for a whole cycle, from one query (fail-closed: a tenant in no
    group shares with nobody but itself)."""
    pairs = set()
    for group in TenantGroup.objects.prefetch_related("tenants"):
        members = sorted(tenant.pk for tenant in group.tenants.all())
        pairs.update(combinations(members, 2))

    def may_share(a: int, b: int) -> bool:
        return a == b or (min(a, b), max(a, b)) in pairs

    return may_share


# --- the snapshot -----------------------------------------------------------------------


# A node the failure policy has given up takes nothing, whatever its status still shows
# (apps/nodes/liveness.py): a task requeued from it would be placed straight back on it.
NODES_SQL = f"""
    SELECT id, status, executable, tenant_id, labels, region, zone, rack, cpu_used, memory_used
    FROM nodes WHERE status = ANY(%s) AND executable AND {liveness.not_given_up_sql("last_heartbeat_at")}
"""
GPUS_SQL = f"""
    SELECT g.node_id, g.index, g.vendor, g.memory_total_mb, g.memory_used_mb, g.utilization, g.temperature,
           g.lost_at IS NOT NULL, g.cordoned_at IS NOT NULL, g.model,
           NOT n.is_container AND lower(g.vendor) = 'nvidia'
               AND n.gpu_capabilities -> (g.index::text) -> 'mig_capable' = 'true'::jsonb
    FROM gpus g JOIN nodes n ON n.id = g.node_id
    WHERE n.status = ANY(%s) AND n.executable AND {liveness.not_given_up_sql("n.last_heartbeat_at")}
"""
PORTS_USED = "SELECT node_id, count(*) FROM tasks WHERE host_port IS NOT NULL AND status = ANY(%s) GROUP BY node_id"
# the ledger is bounded by the number of cards: read it whole
HOLDERS_SQL = "SELECT node_id, gpu_index, task_id, tenant_id, memory_mb FROM gpu_allocations"
# the slices still on a card (bounded by the cards' instances; a partial index holds them):
# a MIG card's carved slices, and the releasing or orphaned ones, which no ledger row holds
LIVE_SLICES_SQL = "SELECT node_id, gpu_index, state, profile, memory_mb FROM slices WHERE state = ANY(%s)"


@dataclass
class GpuRows:
    """The GPU rows one process read, by node, and when (`nodes`: every node that was
    schedulable then, with cards or without)."""

    by_node: dict[str, list[GpuSnap]]
    nodes: frozenset[str]
    read_at: float
    mig: list[GpuSnap] = field(default_factory=list)  # the cards in MIG mode (their carving is per cycle)


_gpu_rows: GpuRows | None = None


def read_gpu_rows(cursor, statuses, heard_since) -> GpuRows:
    """The GPU rows, with the slicing facts that come with them: whether the card is in
    MIG mode (apps.slices.planning.is_mig, from the node's capabilities, in the same
    statement so that the snapshot parses no capabilities document) and its model's MIG
    table. Bind plans each slice against the capabilities as they are then."""
    cursor.execute(GPUS_SQL, [statuses, heard_since])
    by_node: dict[str, list[GpuSnap]] = defaultdict(list)
    in_mig = []
    for node_id, index, vendor, total, used, utilization, temperature, lost, cordoned, model, mig in cursor.fetchall():
        card = GpuSnap(index, vendor, total, lost, used, utilization, temperature, [], model=model, cordoned=cordoned)
        if mig:
            card.mig, card.mig_model = True, mig_model(model, total)
            in_mig.append(card)
        by_node[node_id].append(card)
    for cards in by_node.values():
        cards.sort(key=attrgetter("index"))
    return GpuRows(by_node, frozenset(), 0.0, in_mig)


def load_nodes(reuse_seconds: float = 0.0) -> list[NodeSnap]:
    """The schedulable part of the fleet, in five queries: nodes, GPU rows, host ports in
    use, the ledger, the slices still on the cards (raw rows: at thousands of nodes, building model instances would
    cost more than the decisions; Django's cursor hands jsonb over as text). With
    `reuse_seconds`, the GPU rows this process read that recently are reused when every
    node is known (node rows, ports and the ledger are always fresh): at 5,000 nodes
    they are 40,000 objects to build."""
    global _gpu_rows
    statuses = sorted(SCHEDULABLE_STATUSES)
    heard_since = liveness.heard_since(utcnow())
    with connection.cursor() as cursor:
        cursor.execute(NODES_SQL, [statuses, heard_since])
        node_rows = cursor.fetchall()
        nodes = {
            node_id: NodeSnap(
                node_id,
                status,
                executable,
                tenant_id,
                orjson.loads(labels) if labels else {},
                region,
                zone,
                rack,
                cpu_used,
                memory_used,
                [],
            )
            for node_id, status, executable, tenant_id, labels, region, zone, rack, cpu_used, memory_used in node_rows
        }
        rows = _gpu_rows
        fresh = rows is not None and time.monotonic() - rows.read_at < reuse_seconds and rows.nodes.issuperset(nodes)
        if not fresh:
            rows = read_gpu_rows(cursor, statuses, heard_since)
            rows.nodes, rows.read_at = frozenset(nodes), time.monotonic()
            if reuse_seconds:
                _gpu_rows = rows
        for card in rows.mig:  # a reused row's carving is last cycle's: the slices below are the truth
            card.carved_g = card.carved_memory = 0
        for node_id, node in nodes.items():
            node.gpus = rows.by_node.get(node_id, [])
            for card in node.gpus:
                if card.holders:
                    card.holders = []  # a reused row's holders are last cycle's: the ledger below is the truth
                    card.placed_mb = 0  # and so is what last cycle placed on it
        cursor.execute(PORTS_USED, [list(HOLDING)])
        for node_id, used in cursor.fetchall():
            if node_id in nodes:
                nodes[node_id].ports_free = len(INFERENCE_PORTS) - used
        for node in nodes.values():
            if node.ports_free is None:
                node.ports_free = len(INFERENCE_PORTS)
        cursor.execute(HOLDERS_SQL)
        for node_id, index, task_id, tenant_id, memory in cursor.fetchall():
            node = nodes.get(node_id)
            card = node and card_at(node.gpus, index)
            if card is not None:
                card.holders.append((task_id, tenant_id, memory))
        cursor.execute(LIVE_SLICES_SQL, [list(LIVE_SLICES)])
        for node_id, index, state, profile, memory in cursor.fetchall():
            node = nodes.get(node_id)
            card = node and card_at(node.gpus, index)
            if card is None:
                continue
            if state in UNHELD_SLICES:  # no task, no ledger row: it still takes its room
                card.holders.append((0, None, memory))
            if card.mig and card.mig_model is not None:
                used_g, used_memory = slice_occupancy(card.mig_model, ((profile, memory),))
                card.carved_g += used_g
                card.carved_memory += used_memory
    return list(nodes.values())


UNHELD_SLICES = frozenset({SliceState.RELEASING, SliceState.ORPHANED})


def card_at(cards: list[GpuSnap], index: int) -> GpuSnap | None:
    """The card with this index in a list sorted by index (usually 0..n-1 in place)."""
    if index < len(cards) and cards[index].index == index:
        return cards[index]
    return next((card for card in cards if card.index == index), None)


# The single tasks' queue: tasks outside any group, and the replicas of inference services
# (members of a group placed "replicas", each on its own like a single task; the gang
# groups' members are placed whole, by group_window). The replicas' groups are one hashed
# look-up per statement (a partial index holds them), so the common case, a task outside
# any group, costs what it did.
SINGLE_SQL = "(group_id IS NULL OR group_id IN (SELECT id FROM task_groups WHERE placement = 'replicas'))"
QUEUE_SQL = f"""
    SELECT id, tenant_id, gpu_required, gpu_memory_mb, gpu_type, priority, labels, kind, created_at, group_id
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
    return [
        (
            TaskReq(
                id=task_id,
                tenant_id=tenant_id,
                gpu_required=gpu_required,
                gpu_memory_mb=gpu_memory_mb,
                gpu_type=gpu_type,
                priority=priority,
                labels=orjson.loads(labels) if labels else {},
                kind=kind,
                replica_of=group_id,
            ),
            (-priority, created, task_id),
        )
        for task_id, tenant_id, gpu_required, gpu_memory_mb, gpu_type, priority, labels, kind, created, group_id in rows
    ]


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
           w.members, w.reservation, w.id IN (SELECT id FROM heads)
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
    for gid, tenant_id, per_worker, gpu_type, strategy, prio, labels, kind, created, members, stored, head in rows:
        group = GroupReq(
            id=gid,
            tenant_id=tenant_id,
            members=tuple(members),
            gpus_per_worker=per_worker,
            gpu_type=gpu_type,
            strategy=strategy,
            priority=prio,
            labels=orjson.loads(labels) if labels else {},
            kind=kind,
        )
        window.entries.append((group, (-prio, created, members[0])))
        if head:
            window.heads[gid] = orjson.loads(stored) if isinstance(stored, (str, bytes)) else (stored or {})
    window.entries.sort(key=lambda entry: entry[1])
    return window


# --- no starvation: the reservation ----------------------------------------------------


def reserving_groups(heads: dict[int, dict], now, after_seconds: float) -> dict[int, tuple[str, ...]]:
    """The heads that have waited at the head of their priority for `after_seconds` or
    more, each with the nodes its reservation targeted last cycle (the core keeps them
    first, so the holds accumulate on the same nodes)."""
    reserving = {}
    for group_id, stored in heads.items():
        since = head_since(stored, now)
        if (now - since).total_seconds() >= after_seconds:
            reserving[group_id] = tuple(entry["node_id"] for entry in stored.get("nodes", ()))
    return reserving


def head_since(stored: dict, now):
    """When the group became the head of its priority, by its stored report (now, for a
    group that just became it)."""
    since = stored.get("head_since")
    return datetime.fromisoformat(since) if since else now


def reservation_reports(heads: dict[int, dict], failures, now, after_seconds: float) -> dict[int, dict]:
    """The report to store on each head that is still waiting after this cycle (those
    placed are cleared by bind): since when it is the head, from when it reserves, and
    what it holds (`state` "holding", the nodes with the cards wanted and held on each)
    or "waiting" (not reserving yet, or nothing it could hold: its type's nodes cannot
    take it even when free)."""
    reports = {}
    for failure in failures:
        if failure.group_id not in heads:
            continue
        since = head_since(heads[failure.group_id], now)
        report = {
            "state": "waiting",
            "head_since": since.isoformat(),
            "reserves_after": (since + timedelta(seconds=after_seconds)).isoformat(),
        }
        if failure.reservation is not None:
            report |= {"state": "holding", **failure.reservation.as_dict()}
        reports[failure.group_id] = report | {"at": now.isoformat()}
    return reports


def standing_reservations(priority: int, exclude: int | None = None) -> list[Held]:
    """What the last cycle held for the groups of this priority or higher (their stored
    reports), but `exclude`'s own: the holds a request of that priority would meet now."""
    rows = (
        TaskGroup.objects.filter(reservation__state="holding", priority__gte=priority)
        .exclude(pk=exclude)
        .values_list("pk", "tenant_id", "reservation")
    )
    return [
        Held(pk, tenant_id, {entry["node_id"]: entry["held"] for entry in report.get("nodes", ())})
        for pk, tenant_id, report in rows
    ]


def dry_run(request: TaskReq | GroupReq) -> Decision | Failure | GroupDecision | GroupFailure:
    """Where a task or a task group would go now, or why not: against a fresh snapshot
    and behind the reservations standing for its priority or higher, binding nothing."""
    return explain_now(request)[0]


def explain_now(request: TaskReq | GroupReq) -> tuple[Decision | Failure | GroupDecision | GroupFailure, list[dict]]:
    """dry_run, and for a task kept off by what the cards' readings say is in use
    (`memory_in_use` among its reasons) the cards where that is so, with the ledger's
    and the measured free memory, the reserve and what it needs (core.memory_detail, on
    the same snapshot; computed here, for the explanation, never in the cycle)."""
    exclude = request.id if isinstance(request, GroupReq) else None
    nodes, settings, may_share = load_nodes(), plugin_settings(), sharing_rule()
    placement = place_queue(
        [request], nodes, settings, may_share, held=standing_reservations(request.priority, exclude=exclude)
    )
    outcomes = [*placement.decisions, *placement.failures, *placement.groups, *placement.group_failures]
    outcome = outcomes[0]
    cards: list[dict] = []
    if isinstance(outcome, Failure) and "memory_in_use" in outcome.removed:
        # the placement took nothing (it failed): the snapshot is as it was read
        cards = memory_detail(request, nodes, settings, may_share)
    return outcome, cards


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
    )


def waiting_group(group: TaskGroup) -> GroupReq | None:
    """The group as placement would see it, if it is waiting to be placed (every current
    member pending, every rank there); None otherwise (bound, running, ending), and for a
    replicas group (its members are placed one by one, never as a group)."""
    if group.placement == GroupPlacement.REPLICAS:
        return None
    current = list(group.tasks.exclude(status__in=TERMINAL).order_by("rank").values_list("pk", "status"))
    if len(current) != group.world_size or any(status != S.PENDING for _, status in current):
        return None
    return GroupReq(
        id=group.pk,
        tenant_id=group.tenant_id,
        members=tuple(pk for pk, _ in current),
        gpus_per_worker=group.gpus_per_worker,
        gpu_type=group.gpu_type,
        strategy=group.strategy,
        priority=group.priority,
        labels=group.labels or {},
        kind=group.kind,
    )


# A head's report, written by every scheduler process that ran the cycle (the same report
# for the same head): a row another one is writing (or a bind is clearing) is skipped, not
# waited for, so the statement never waits on a lock and never joins a deadlock. The
# reports of groups that are no longer heads are cleared by the window's statement.
STORE_RESERVATIONS = """
    UPDATE task_groups AS g SET reservation = v.report
    FROM unnest(%s::bigint[], %s::jsonb[]) AS v(id, report)
    WHERE g.id = v.id
      AND g.id IN (SELECT id FROM task_groups WHERE id = ANY(%s) ORDER BY id FOR UPDATE SKIP LOCKED)
"""


def store_reservations(reports: dict[int, dict]) -> None:
    """Write this cycle's reservation reports, one per head still waiting."""
    if not reports:
        return
    ids = list(reports)
    documents = [orjson.dumps(report).decode() for report in reports.values()]
    with connection.cursor() as cursor:
        cursor.execute(STORE_RESERVATIONS, [ids, documents, ids])


# --- bind -------------------------------------------------------------------------------


# Inference services are published on a host port of their node.
INFERENCE_PORTS = range(8000, 9000)
PORTS_IN_USE = """
    SELECT node_id, host_port FROM tasks
    WHERE node_id = ANY(%s) AND host_port IS NOT NULL AND status = ANY(%s)
"""


def assign_host_ports(
    decisions: list[Decision], tasks: dict[int, TaskReq], node_ids, wanted: list[Decision] | None = None
) -> dict[int, int | None]:
    """A free port of INFERENCE_PORTS on its node for each inference decision (or each of
    `wanted`: a task group's master) and None for the others; a decision whose node has
    no port left is not in the answer. The caller holds the nodes' row locks, so no
    other binder hands out the same port (and a unique index backs that up)."""
    if wanted is None:
        wanted = [d for d in decisions if tasks[d.task_id].kind == TaskKind.INFERENCE]
    ports: dict[int, int | None] = {d.task_id: None for d in decisions if d not in wanted}
    if not wanted:
        return ports
    used: dict[str, set[int]] = defaultdict(set)
    with connection.cursor() as cursor:
        cursor.execute(PORTS_IN_USE, [sorted(node_ids), list(HOLDING)])
        for node_id, port in cursor.fetchall():
            used[node_id].add(port)
    for decision in wanted:
        taken = used[decision.node_id]
        port = next((p for p in INFERENCE_PORTS if p not in taken), None)
        if port is not None:
            taken.add(port)
            ports[decision.task_id] = port
    return ports


def ports_wanted(group: GroupDecision, tasks: dict[int, TaskReq]) -> list[Decision]:
    """The members of a group that get a host port at bind: every member of an inference
    group (each replica serves on its own port), only the master of a training group
    (MASTER_PORT, where rank 0 listens for the rendezvous)."""
    if tasks[group.decisions[0].task_id].kind == TaskKind.INFERENCE:
        return list(group.decisions)
    return group.decisions[:1]


def bind_all(
    decisions: list[Decision],
    tasks: dict[int, TaskReq],
    may_share,
    settings: PluginSettings | None = None,
    groups: Sequence[GroupDecision] = (),
) -> tuple[list[int], list[int]]:
    """Bind a cycle's decisions in one transaction: lock their nodes (in id order, so
    concurrent schedulers queue rather than deadlock), drop the decisions the live ledger
    now contradicts (a node gone, a card taken, a holder this tenant may not share with),
    plan the slice of each memory-only decision on its card as it is now (a decision
    whose slice cannot be planned is dropped, its task keeps waiting with the reason),
    move the rest pending → scheduled in one multi-row compare-and-set, and write the
    ledger rows of the winners and their slices (with the agent's create requests). A
    task group (`groups`; its members' TaskReq in `tasks`) is bound whole or not at all:
    one contradicted member drops the group, and its members' compare-and-set runs in a
    savepoint of its own that is rolled back unless every member won. Returns (bound,
    lost), task ids (members of groups included)."""
    members = [d for g in groups for d in g.decisions]
    if not decisions and not members:
        return [], []
    check_transition(TRANSITIONS, [S.PENDING], S.SCHEDULED)  # before any lock is taken
    with transaction.atomic():
        node_ids = sorted({d.node_id for d in (*decisions, *members)})
        settings = settings or PluginSettings()
        # the load thresholds again, on the node rows as they are now
        alive = set(
            Node.objects.select_for_update()
            .filter(pk__in=node_ids, status__in=SCHEDULABLE_STATUSES, executable=True)
            .exclude(Q(cpu_used__gte=settings.cpu_percent_max) | Q(memory_used__gte=settings.memory_percent_max))
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        # the cards as they are now (the snapshot's GPU rows may be a few seconds old):
        # present, not lost, not cordoned, and under the card thresholds (a missing
        # reading is no load)
        usable = set(
            Gpu.objects.filter(node_id__in=alive, lost_at__isnull=True, cordoned_at__isnull=True)
            .exclude(
                Q(utilization__gte=settings.gpu_utilization_max) | Q(temperature__gte=settings.gpu_temperature_max)
            )
            .exclude(
                memory_total_mb__gt=0, memory_used_mb__gte=F("memory_total_mb") * settings.gpu_memory_percent_max / 100
            )
            .values_list("node_id", "index")
        )
        holders = defaultdict(list)
        for node_id, index, tenant_id, memory in GpuAllocation.objects.filter(node_id__in=alive).values_list(
            "node_id", "gpu_index", "tenant_id", "memory_mb"
        ):
            holders[(node_id, index)].append((tenant_id, memory))

        def still_holds(decision: Decision) -> bool:
            task = tasks[decision.task_id]
            cards = [holders[(decision.node_id, index)] for index in decision.gpu_indices]
            if decision.node_id not in alive:
                return False
            if any((decision.node_id, index) not in usable for index in decision.gpu_indices):
                return False
            if decision.memory_mb is None and any(cards):
                return False
            return decision.memory_mb is None or not any(
                memory is None or not may_share(task.tenant_id, tenant_id)
                for card in cards
                for tenant_id, memory in card
            )

        still_valid = [decision for decision in decisions if still_holds(decision)]
        now = utcnow()
        # a memory-only task's slice, planned on the card as it is now: one that cannot be
        # planned (no MIG profile left) drops its decision before the CAS
        carves = slice_ledger.plan_carves(
            [
                slice_ledger.CarveAsk(
                    d.task_id, tasks[d.task_id].tenant_id, d.node_id, index, tasks[d.task_id].gpu_memory_mb
                )
                for d in still_valid
                if d.memory_mb is not None
                for index in d.gpu_indices
            ]
        )
        refused = {task_id: plan for task_id, plan in carves.items() if isinstance(plan, Refusal)}
        if refused:
            still_valid = [d for d in still_valid if d.task_id not in refused]
            explain_refusals(refused, now)
        ports = assign_host_ports(still_valid, tasks, alive)
        still_valid = [d for d in still_valid if d.task_id in ports]
        bound_rows = bind_rows(still_valid, ports, now)
        won = {row[0] for row in bound_rows}
        winners = [d for d in still_valid if d.task_id in won]
        slice_ledger.carve([carves[d.task_id] for d in winners if d.task_id in carves], now)
        hosts = {
            node.pk: node
            for node in Node.objects.filter(pk__in={d.node_id for d in members} & alive).only(
                "id", "ip", "internal_ip", "region", "labels"
            )
        }
        policy = django_settings.HETEROFLOW_NETWORK_DOMAIN_POLICY
        holding = [group for group in groups if all(still_holds(d) for d in group.decisions)]
        # the ports every holding group wants (a training group's master, each member of an
        # inference group) in one look at the ports in use (the singles' included)
        wanted_by_group = {group.group_id: ports_wanted(group, tasks) for group in holding}
        wanted = [d for group_wanted in wanted_by_group.values() for d in group_wanted]
        all_ports = assign_host_ports(wanted, tasks, alive, wanted=wanted)
        networks: dict[int, dict] = {}
        for group in holding:
            master = group.decisions[0]
            if any(d.task_id not in all_ports for d in wanted_by_group[group.group_id]):
                continue  # no host port left on a node that needs one
            ports = {d.task_id: all_ports.get(d.task_id) for d in group.decisions}
            node = hosts[master.node_id]
            domain = same_network_domain(
                [hosts[node_id] for node_id in dict.fromkeys(d.node_id for d in group.decisions)], policy
            )
            network = network_decision(
                tasks[master.task_id].gpu_type, domain, node.pk, node.internal_ip, node.ip, ports[master.task_id]
            )
            savepoint = transaction.savepoint()
            rows = bind_rows(group.decisions, ports, now)
            if len(rows) == len(group.decisions):
                transaction.savepoint_commit(savepoint)
                networks[group.group_id] = network
                bound_rows += rows
                winners += group.decisions
            else:  # a member was moved meanwhile: none of them is bound
                transaction.savepoint_rollback(savepoint)
        if networks:  # the bound groups' attempt and network, in one statement
            with connection.cursor() as cursor:
                cursor.execute(
                    GROUPS_BOUND,
                    [now, list(networks), [orjson.dumps(network).decode() for network in networks.values()]],
                )
        transaction.on_commit(partial(metrics.record_binds, [float(row[1]) for row in bound_rows]))
        cards = [(d, index) for d in winners for index in d.gpu_indices]
        if cards:
            with connection.cursor() as cursor:
                cursor.execute(
                    ALLOCATE,
                    [
                        now,
                        [d.task_id for d, _ in cards],
                        [d.node_id for d, _ in cards],
                        [index for _, index in cards],
                        [tasks[d.task_id].tenant_id for d, _ in cards],
                        # a share holds what is carved (a MIG slice: its profile's memory)
                        [carves[d.task_id].plan.memory_mb if d.task_id in carves else d.memory_mb for d, _ in cards],
                    ],
                )
    won = {d.task_id for d in winners}
    every = [*decisions, *members]
    return [d.task_id for d in every if d.task_id in won], [d.task_id for d in every if d.task_id not in won]


def explain_refusals(refused: dict[int, Refusal], now) -> None:
    """Why a decision was dropped at bind for its slice (the task stays pending)."""
    with connection.cursor() as cursor:
        cursor.execute(
            EXPLAIN,
            [
                list(refused),
                [
                    orjson.dumps({"code": r.code, "message": r.message, "at": now.isoformat()}).decode()
                    for r in refused.values()
                ],
            ],
        )


GROUPS_BOUND = """
    UPDATE task_groups AS g SET attempts = g.attempts + 1, schedule_reason = '{}'::jsonb,
        reservation = '{}'::jsonb, network = v.network, updated_at = %s
    FROM unnest(%s::bigint[], %s::jsonb[]) AS v(id, network) WHERE g.id = v.id
"""


def bind_rows(decisions: Sequence[Decision], ports: dict[int, int | None], now) -> list[tuple]:
    """The multi-row compare-and-set pending → scheduled: each task onto its node (with
    its host port, if any). Returns the winners' (id, seconds it waited)."""
    return compare_and_set(
        Task._meta.db_table,
        TRANSITIONS,
        [d.task_id for d in decisions],
        [S.PENDING],
        S.SCHEDULED,
        fixed={"schedule_reason": Jsonb({}), "updated_at": now},
        per_row={
            "node_id": ("text", [d.node_id for d in decisions]),
            "host_port": ("int", [ports.get(d.task_id) for d in decisions]),
        },
        returning="extract(epoch FROM tasks.updated_at - tasks.created_at)",
    )


# --- one cycle --------------------------------------------------------------------------


@dataclass
class CycleResult:
    considered: int = 0
    bound: list[int] = field(default_factory=list)
    lost_races: list[int] = field(default_factory=list)
    failed: dict[int, dict] = field(default_factory=dict)
    backlog: bool = False
    preemptions: dict[int, PreemptionPlan] = field(default_factory=dict)
    # task groups: bound whole this cycle, and why the others wait (their members'
    # task ids are in bound / lost_races / failed as well)
    groups_bound: list[int] = field(default_factory=list)
    groups_failed: dict[int, dict] = field(default_factory=dict)
    # seconds spent in each phase, for the benchmark and the cycle metrics
    phases: dict[str, float] = field(default_factory=dict)


# --- preemption -------------------------------------------------------------------------

# Placement failures that may be answered by preemption (a tenant-sharing failure is not:
# evicting another tenant's task to share its card would defeat the sharing rule).
PREEMPTION_TRIGGERS = ("InsufficientResources", "NoSchedulableNodes")
OCCUPANTS_SQL = """
    SELECT t.id, t.node_id, t.status, t.kind, t.preemptible, t.priority, extract(epoch FROM t.created_at)
    FROM tasks t
    WHERE t.node_id IS NOT NULL
      AND (t.status = 'preempting' OR (t.kind = 'job' AND t.preemptible AND t.status = ANY(%s)))
      AND EXISTS (SELECT 1 FROM gpu_allocations a WHERE a.task_id = t.id)
"""


def load_occupants(stage: str) -> list[Occupant]:
    """The tasks that could give cards back: possible victims for this stage, and the
    tasks already being preempted."""
    with connection.cursor() as cursor:
        cursor.execute(OCCUPANTS_SQL, [sorted(VICTIM_STATUSES[stage])])
        return [
            Occupant(id, node_id, status, kind, preemptible, priority, float(created))
            for id, node_id, status, kind, preemptible, priority, created in cursor.fetchall()
        ]


def preempt_for(
    failures: list[Failure], tasks: dict[int, TaskReq], nodes: list[NodeSnap], settings: PluginSettings, may_share
) -> dict[int, PreemptionPlan]:
    """The preempt plugin, after placement: for each task that did not fit (in queue
    order), plan the minimal eviction, then move every planned victim running →
    preempting in one CAS. Nothing is released here: the cards stay counted until the
    agent confirms the stop (or the watchdog forces it)."""
    hopeful = [f for f in failures if f.code in PREEMPTION_TRIGGERS and tasks[f.task_id].kind != TaskKind.TRAINING]
    if not hopeful or settings.preempt_stage not in VICTIM_STATUSES or settings.preempt_stage == "disabled":
        return {}
    by_node = occupants_by_node(load_occupants(settings.preempt_stage))
    if not by_node:
        return {}
    plans: dict[int, PreemptionPlan] = {}
    taken: set[int] = set()
    for failure in hopeful:
        plan = plan_preemption(tasks[failure.task_id], nodes, by_node, settings, may_share, taken)
        if plan is not None:
            plans[plan.task_id] = plan
            taken.update(plan.victims)
    if taken:
        won = set(move_tasks(sorted(taken), sorted(VICTIM_STATUSES[settings.preempt_stage]), S.PREEMPTING))
        for plan in plans.values():
            plan.victims = [victim for victim in plan.victims if victim in won]
    return plans


PREEMPTION_GRACE = timedelta(seconds=60)


def force_overdue_preemptions(now=None) -> list[int]:
    """The watchdog (every 30 s): a task preempting for more than 60 s without the
    agent's confirmation is moved back to the queue through the same CAS, and its cards
    are released; a late confirmation then loses and changes nothing. Each forced task
    raises PREEMPTION_TIMEOUT."""
    cutoff = (now or utcnow()) - PREEMPTION_GRACE
    overdue = {
        pk: (node_id, tenant_id)
        for pk, node_id, tenant_id in Task.objects.filter(status=S.PREEMPTING, updated_at__lt=cutoff).values_list(
            "pk", "node_id", "tenant_id"
        )
    }
    forced = requeue_preempted(sorted(overdue))
    for pk in forced:
        node_id, tenant_id = overdue[pk]
        raise_alert(
            type=AlertType.PREEMPTION_TIMEOUT,
            severity=Severity.WARNING,
            scope=AlertScope.TASK,
            task_id=pk,
            key=alert_keys.preemption_timeout(pk),
            message=f"Task {pk} was not confirmed stopped on node {node_id} within 60 s of its preemption; "
            f"its cards were released and it was requeued.",
            node_id=node_id or "",
            tenant_id=tenant_id,
            details={"task_id": pk},
        )
    return forced


# why the last cycle did not place them (only still-pending tasks: a racer may have bound one)
EXPLAIN = """
    UPDATE tasks AS t SET schedule_reason = v.reason
    FROM unnest(%s::bigint[], %s::jsonb[]) AS v(id, reason)
    WHERE t.id = v.id AND t.status = 'pending'
"""


EXPLAIN_GROUPS = """
    UPDATE task_groups AS g SET schedule_reason = v.reason
    FROM unnest(%s::bigint[], %s::jsonb[]) AS v(id, reason) WHERE g.id = v.id
"""


def run_cycle(batch_size: int = BATCH_SIZE) -> CycleResult:
    # A cycle allocates tens of thousands of short-lived objects (the snapshot) that the
    # cyclic collector would traverse again and again; reference counting frees them.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run_cycle(batch_size)
    finally:
        if collecting:
            gc.enable()


def _run_cycle(batch_size: int) -> CycleResult:
    result = CycleResult()
    clock = PhaseClock(result.phases)
    ordered = next_batch_ordered(batch_size)
    batch = [task for task, _ in ordered]
    result.backlog, groups_waiting = queue_state(len(batch))
    window = group_window() if groups_waiting else GroupWindow()
    groups = window.entries
    result.considered = len(batch) + sum(group.world_size for group, _ in groups)
    if not batch and not groups:
        return result
    # one queue: a group is decided after the singles ahead of it (higher priority, or
    # older at the same priority) and before those behind it
    queue = [item for item, _ in sorted([*ordered, *groups], key=lambda entry: entry[1])]
    may_share = sharing_rule()
    settings = plugin_settings()
    clock.lap("queue")
    nodes = load_nodes(reuse_seconds=django_settings.HETEROFLOW_SCHEDULER_GPU_REUSE_SECONDS)
    siblings = replicas_on_nodes(batch)  # where the batch's services run already (no query without replicas)
    clock.lap("snapshot")
    started = utcnow()
    reserve_after = django_settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS
    reserving = reserving_groups(window.heads, started, reserve_after)
    placement = place_queue(queue, nodes, settings, may_share, reserving=reserving, siblings=siblings)
    decisions, failures = placement.decisions, placement.failures
    clock.lap("decide")
    tasks = {task.id: task for task in batch}
    for group, _ in groups:
        tasks.update((member, group.worker(rank)) for rank, member in enumerate(group.members))
    result.bound, result.lost_races = bind_all(decisions, tasks, may_share, settings, groups=placement.groups)
    bound = set(result.bound)
    result.groups_bound = [g.group_id for g in placement.groups if g.decisions[0].task_id in bound]
    clock.lap("bind")
    result.preemptions = preempt_for(failures, tasks, nodes, settings, may_share)
    clock.lap("preempt")
    now = utcnow().isoformat()
    for failure in failures:
        reason = failure.as_reason() | {"at": now}
        plan = result.preemptions.get(failure.task_id)
        if plan is not None:
            # the preemptor waits: next cycle binds against the real ledger
            reason |= {
                "code": "PreemptionPending",
                "cause": failure.code,
                "preemption": {"node_id": plan.node_id, "victims": plan.victims},
            }
        result.failed[failure.task_id] = reason
    members = {group.id: group.members for group, _ in groups}
    reports = reservation_reports(window.heads, placement.group_failures, started, reserve_after)
    for failure in placement.group_failures:
        reason = result.groups_failed[failure.group_id] = failure.as_reason() | {"at": now}
        if failure.group_id in reports:
            reason["reservation"] = reports[failure.group_id]
        # the members say why in a line and point at the group, which has the details
        brief = {key: value for key, value in reason.items() if key != "reservation"} | {"group": failure.group_id}
        for member in members[failure.group_id]:
            result.failed[member] = brief
    store_reservations(reports)
    if result.failed:
        with connection.cursor() as cursor:
            cursor.execute(
                EXPLAIN, [list(result.failed), [orjson.dumps(reason).decode() for reason in result.failed.values()]]
            )
            if result.groups_failed:
                cursor.execute(
                    EXPLAIN_GROUPS,
                    [
                        list(result.groups_failed),
                        [orjson.dumps(reason).decode() for reason in result.groups_failed.values()],
                    ],
                )
    clock.lap("explain")
    return result


class PhaseClock:
    def __init__(self, into: dict[str, float]):
        self.into = into
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = now - self.last
        self.last = now
