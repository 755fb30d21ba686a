"""The snapshot: the schedulable part of the fleet in five raw queries (nodes, GPU rows,
host ports and inference replicas in use, the ledger, the slices still on the cards),
and where the queue's models are in at most two more (read_models); and the GPU rows a
scheduler process may reuse between its cycles (GpuRowCache, owned by the tick)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from operator import attrgetter

import orjson
from django.db import connection

from apps.core.clock import utcnow
from apps.inference.models import Model
from apps.nodes import liveness
from apps.nodes.model_cache import found_on, may_hold
from apps.nodes.models import Node
from apps.scheduler import bind
from apps.scheduler.core import (
    NO_MODELS,
    SCHEDULABLE_STATUSES,
    GpuSnap,
    ModelSpread,
    NodeSnap,
)
from apps.slices.choices import LIVE as LIVE_SLICES
from apps.slices.choices import SliceState
from apps.slices.planning import mig_model
from apps.slices.planning import occupancy as slice_occupancy
from apps.tasks.choices import HOLDING, TaskKind, TaskStatus

# A node the failure policy has given up takes nothing, whatever its status still shows
# (apps/nodes/liveness.py): a task requeued from it would be placed straight back on it.
NODES_SQL = f"""
    SELECT id, status, executable, tenant_id, labels, region, zone, rack, cpu_used, memory_used, exec_mode
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
# per node: the host ports its tasks hold, and its inference replicas (the cap counts them)
PORTS_USED = f"""
    SELECT node_id, count(*) FILTER (WHERE host_port IS NOT NULL), count(*) FILTER (WHERE kind = '{TaskKind.INFERENCE}')
    FROM tasks WHERE (host_port IS NOT NULL OR kind = '{TaskKind.INFERENCE}') AND status = ANY(%s) GROUP BY node_id
"""
# the models of the inference services with a replica waiting, with the nodes each model
# is pinned to (Model.nodes; an empty array: not pinned)
QUEUED_MODELS_SQL = f"""
    SELECT s.group_id, m.id, m.tenant_id, m.name, m.source_kind, m.source,
           ARRAY(SELECT p.node_id FROM {Model.nodes.through._meta.db_table} p WHERE p.model_id = m.id)
    FROM inference_services s JOIN {Model._meta.db_table} m ON m.id = s.model_id
    WHERE s.group_id IN (
        SELECT group_id FROM tasks
        WHERE status = '{TaskStatus.PENDING}' AND kind = '{TaskKind.INFERENCE}' AND group_id IS NOT NULL
    )
"""
# the ledger is bounded by the number of cards: read it whole
HOLDERS_SQL = "SELECT node_id, gpu_index, task_id, tenant_id, memory_mb FROM gpu_allocations"
# When the work holding cards is expected to end (backfill dates reservations by it): from
# its start (a bound task not started yet: from now) plus its declared duration, else its
# timeout, past which the agent stops it either way. One row per task in the ledger.
EXPECTED_ENDS_SQL = """
    SELECT t.id, extract(epoch FROM coalesce(t.started_at, %s)) + coalesce(t.max_duration_seconds, t.timeout_seconds)
    FROM tasks t WHERE t.id IN (SELECT DISTINCT task_id FROM gpu_allocations)
"""
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


class GpuRowCache:
    """The GPU rows a scheduler process read, kept for its next cycles: the tick owns one
    (apps.scheduler.jobs) and hands it to every cycle it runs. At 5,000 nodes the rows
    are 40,000 objects to build."""

    def __init__(self) -> None:
        self.rows: GpuRows | None = None

    def fresh(self, nodes, reuse_seconds: float) -> GpuRows | None:
        """The rows kept, if read less than `reuse_seconds` ago while every node in
        `nodes` was schedulable (a node new since then makes them be read again)."""
        rows = self.rows
        if rows is not None and time.monotonic() - rows.read_at < reuse_seconds and rows.nodes.issuperset(nodes):
            return rows
        return None


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


def load_nodes(reuse_seconds: float = 0.0, gpu_rows: GpuRowCache | None = None) -> list[NodeSnap]:
    """The schedulable part of the fleet, in five queries: nodes, GPU rows, host ports and
    inference replicas in use, the ledger, the slices still on the cards (raw rows: at
    thousands of nodes, building model instances would cost more than the decisions;
    Django's cursor hands jsonb over as text). With `reuse_seconds` and a `gpu_rows`
    cache, the GPU rows it holds from that recently are reused when every node is known
    (node rows, ports and the ledger are always fresh).
    Then where the queue's models are (read_models), on every node."""
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
                exec_mode=exec_mode,
            )
            for (
                node_id,
                status,
                executable,
                tenant_id,
                labels,
                region,
                zone,
                rack,
                cpu_used,
                memory_used,
                exec_mode,
            ) in node_rows
        }
        rows = gpu_rows.fresh(nodes, reuse_seconds) if gpu_rows is not None else None
        if rows is None:
            rows = read_gpu_rows(cursor, statuses, heard_since)
            rows.nodes, rows.read_at = frozenset(nodes), time.monotonic()
            if reuse_seconds and gpu_rows is not None:
                gpu_rows.rows = rows
        for card in rows.mig:  # a reused row's carving is last cycle's: the slices below are the truth
            card.carved_g = card.carved_memory = 0
        for node_id, node in nodes.items():
            node.gpus = rows.by_node.get(node_id, [])
            for card in node.gpus:
                if card.holders:
                    card.holders = []  # a reused row's holders are last cycle's: the ledger below is the truth
                    card.placed_mb = 0  # and so is what last cycle placed on it
        cursor.execute(PORTS_USED, [list(HOLDING)])
        for node_id, used, replicas in cursor.fetchall():
            node = nodes.get(node_id)
            if node is not None:
                node.ports_free = len(bind.INFERENCE_PORTS) - used
                node.inference_replicas = replicas
        for node in nodes.values():
            if node.ports_free is None:
                node.ports_free = len(bind.INFERENCE_PORTS)
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
        spread = read_models(cursor, nodes)
    if spread is not NO_MODELS:
        for node in nodes.values():
            node.models = spread
    return list(nodes.values())


@dataclass(frozen=True)
class QueuedModel:
    """A queued service's model, as the cache rule reads it."""

    id: int
    tenant_id: int
    name: str
    source_kind: str
    source: str


def expected_ends(now) -> dict[int, float]:
    """Task id -> when it is expected to end (epoch seconds), for every task holding cards."""
    with connection.cursor() as cursor:
        cursor.execute(EXPECTED_ENDS_SQL, [now])
        return {task_id: float(end) for task_id, end in cursor.fetchall()}


def holds(model: QueuedModel, node) -> bool:
    """Whether the node holds the model (apps.nodes.model_cache.found_on, the registry's
    rule), and the model's tenant may use the node."""
    if node.tenant_id not in (None, model.tenant_id):
        return False
    matches, labelled = found_on(model, node)
    return bool(matches) or labelled


def read_models(cursor, nodes: dict[str, NodeSnap]) -> ModelSpread:
    """Where the models of the services with a replica waiting are: the nodes each is
    pinned to, in one query, and the schedulable nodes that hold it, in one more (only
    when a replica waits; the candidates are narrowed in SQL, the rule is `holds`)."""
    cursor.execute(QUEUED_MODELS_SQL)
    rows = cursor.fetchall()
    if not rows:
        return NO_MODELS
    pinned: dict[int, frozenset[str]] = {}
    by_service: dict[int, QueuedModel] = {}
    for service, model_id, tenant_id, name, source_kind, source, pins in rows:
        by_service[service] = QueuedModel(model_id, tenant_id, name, source_kind, source)
        if pins:
            pinned[service] = frozenset(pins)
    models = {model.id: model for model in by_service.values()}
    candidates = may_hold(Node.objects.filter(pk__in=list(nodes)), models.values()).only(
        "id", "tenant_id", "discovered_models", "labels"
    )
    holders: dict[int, set[str]] = defaultdict(set)
    for node in candidates:
        for model in models.values():
            if holds(model, node):
                holders[model.id].add(node.pk)
    cached = {service: frozenset(holders[model.id]) for service, model in by_service.items() if holders.get(model.id)}
    return ModelSpread(pinned, cached)


UNHELD_SLICES = frozenset({SliceState.RELEASING, SliceState.ORPHANED})


def card_at(cards: list[GpuSnap], index: int) -> GpuSnap | None:
    """The card with this index in a list sorted by index (usually 0..n-1 in place)."""
    if index < len(cards) and cards[index].index == index:
        return cards[index]
    return next((card for card in cards if card.index == index), None)
