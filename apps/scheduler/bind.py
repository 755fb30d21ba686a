"""Bind a cycle's decisions in one transaction: the nodes locked and the live cards read
(LiveCards), the singles moved pending → scheduled in one multi-row CAS and each task
group in a savepoint of its own (all its members or none), then the ledger rows."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import orjson
from django.conf import settings as django_settings
from django.db import connection, transaction
from psycopg.types.json import Jsonb

from apps.core.cas import check_transition, compare_and_set
from apps.core.clock import utcnow
from apps.monitoring import metrics
from apps.nodes.models import Node
from apps.nodes.network import NODE_FIELDS as NETWORK_FIELDS
from apps.nodes.network import same_network_domain
from apps.scheduler.core import (
    SCHEDULABLE_STATUSES,
    BindFound,
    Decision,
    GroupDecision,
    PluginSettings,
    TaskReq,
)
from apps.scheduler.ledger import ALLOCATE
from apps.scheduler.load import CARD_UNDER_LOAD_SQL, NODE_OVERLOADED_SQL, load_params
from apps.slices import ledger as slice_ledger
from apps.slices.planning import Refusal
from apps.tasks.choices import HOLDING, TRANSITIONS, TaskKind
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task
from apps.tasks.ranks import network_decision

# Inference services are published on a host port of their node (and a training group's
# master listens on one): HETEROFLOW_HOST_PORT_FIRST…LAST.
INFERENCE_PORTS = range(django_settings.HETEROFLOW_HOST_PORT_FIRST, django_settings.HETEROFLOW_HOST_PORT_LAST + 1)
PORTED_KINDS = (TaskKind.INFERENCE, TaskKind.INTERACTIVE)
PORTS_IN_USE = """
    SELECT node_id, host_port FROM tasks
    WHERE node_id = ANY(%s) AND host_port IS NOT NULL AND status = ANY(%s)
"""


def assign_host_ports(
    decisions: list[Decision], tasks: dict[int, TaskReq], node_ids, wanted: list[Decision] | None = None
) -> dict[int, int | None]:
    """A free port of INFERENCE_PORTS on its node for each inference or interactive
    decision (its server listens there; or each of `wanted`: a task group's master) and
    None for the others; a decision whose node has
    no port left is not in the answer. The caller holds the nodes' row locks, so no
    other binder hands out the same port (and a unique index backs that up)."""
    if wanted is None:
        wanted = [d for d in decisions if tasks[d.task_id].kind in PORTED_KINDS]
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


# The nodes a bind may place on, as they are now, locked in id order (concurrent binders
# queue rather than deadlock): schedulable, executable, below the node load thresholds.
LOCK_NODES = f"""
    SELECT id FROM nodes
    WHERE id = ANY(%(nodes)s) AND status = ANY(%(statuses)s) AND executable AND NOT {NODE_OVERLOADED_SQL}
    ORDER BY id FOR UPDATE
"""
# Their cards as they are now (the snapshot's GPU rows may be a few seconds old): present,
# not lost, not cordoned, and below the card load thresholds (a missing reading is no load).
USABLE_CARDS = f"""
    SELECT node_id, index FROM gpus
    WHERE node_id = ANY(%(alive)s) AND lost_at IS NULL AND cordoned_at IS NULL AND {CARD_UNDER_LOAD_SQL}
"""
LIVE_HOLDERS = (
    "SELECT node_id, gpu_index, task_id, tenant_id, memory_mb FROM gpu_allocations WHERE node_id = ANY(%(alive)s)"
)
# Why bind refuses a decision the live rows contradict: its node no longer takes work, or
# its cards are no longer there for it (missing, lost, cordoned, loaded, taken), or a
# holder there is one its tenant may not share with. The first two are what placement
# would have said on the live rows, and may be answered by preemption, as a placement
# failure is (apps.scheduler.preemption.PREEMPTION_TRIGGERS); the third never is.
NODE_GONE, CARDS_GONE, NOT_SHAREABLE = "NoSchedulableNodes", "InsufficientResources", "NoTenantEligibleGPU"


@dataclass
class LiveCards:
    """The nodes and cards a bind checks its decisions against, read under the node locks
    (`alive`: the nodes locked and still fit to take work; `usable`: their cards that may
    take a placement; `holders`: the ledger's (task id, tenant, memory MB or None) on each
    card)."""

    alive: set[str]
    usable: set[tuple[str, int]]
    holders: dict[tuple[str, int], list[tuple[int, int | None, int | None]]]

    @classmethod
    def read(cls, node_ids: Sequence[str], settings: PluginSettings) -> LiveCards:
        """Lock the nodes (in id order) and read them, their cards and the ledger on them."""
        params = load_params(settings) | {"nodes": sorted(node_ids), "statuses": sorted(SCHEDULABLE_STATUSES)}
        with connection.cursor() as cursor:
            cursor.execute(LOCK_NODES, params)
            alive = {node_id for (node_id,) in cursor.fetchall()}
            params["alive"] = sorted(alive)
            cursor.execute(USABLE_CARDS, params)
            usable = set(cursor.fetchall())
            cursor.execute(LIVE_HOLDERS, params)
            holders = defaultdict(list)
            for node_id, index, task_id, tenant_id, memory in cursor.fetchall():
                holders[(node_id, index)].append((task_id, tenant_id, memory))
        return cls(alive, usable, holders)

    def refusal(self, decision: Decision, task: TaskReq, may_share) -> str | None:
        """Why the live rows no longer admit the decision (NODE_GONE, CARDS_GONE,
        NOT_SHAREABLE), None when they do: its node alive, its cards usable, and (a
        share) every holder there one the task's tenant may share with, or (whole cards)
        nobody on them."""
        if decision.node_id not in self.alive:
            return NODE_GONE
        if any((decision.node_id, index) not in self.usable for index in decision.gpu_indices):
            return CARDS_GONE
        cards = [self.holders.get((decision.node_id, index), ()) for index in decision.gpu_indices]
        if decision.memory_mb is None:
            return CARDS_GONE if any(cards) else None
        if any(memory is None for card in cards for _, _, memory in card):
            return CARDS_GONE
        if any(not may_share(task.tenant_id, tenant_id) for card in cards for _, tenant_id, _ in card):
            return NOT_SHAREABLE
        return None

    def still_holds(self, decision: Decision, task: TaskReq, may_share) -> bool:
        """Whether the live rows still admit the decision (no refusal)."""
        return self.refusal(decision, task, may_share) is None

    def found(self, node_id: str) -> BindFound:
        """The node as read here, for preemption planning after a refusal on it."""
        return BindFound(
            node_id in self.alive,
            frozenset(index for node, index in self.usable if node == node_id),
            {index: tuple(found) for (node, index), found in self.holders.items() if node == node_id},
        )


@dataclass
class Bound:
    """What a bind has won so far: the decisions, their compare-and-set rows (id, seconds
    it waited) and the slices carved for the memory-only ones (by task id); and the
    single tasks' decisions the live rows refused, with why (LiveCards.refusal)."""

    decisions: list[Decision] = field(default_factory=list)
    rows: list[tuple] = field(default_factory=list)
    carves: dict[int, slice_ledger.Carve] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)


@dataclass
class BindOutcome:
    """A cycle's bind: the task ids bound and lost (members of groups included), and of
    the lost single tasks, those whose node had changed under the decision (`refused`:
    task id -> NODE_GONE, CARDS_GONE or NOT_SHAREABLE), with their nodes as bind found
    them (`found`, node id -> BindFound), for preemption."""

    bound: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    found: dict[str, BindFound] = field(default_factory=dict)


def bind_all(
    decisions: list[Decision],
    tasks: dict[int, TaskReq],
    may_share,
    settings: PluginSettings | None = None,
    groups: Sequence[GroupDecision] = (),
) -> tuple[list[int], list[int]]:
    """bind_decisions, answering (bound, lost) task ids."""
    outcome = bind_decisions(decisions, tasks, may_share, settings, groups)
    return outcome.bound, outcome.lost


def bind_decisions(
    decisions: list[Decision],
    tasks: dict[int, TaskReq],
    may_share,
    settings: PluginSettings | None = None,
    groups: Sequence[GroupDecision] = (),
) -> BindOutcome:
    """Bind a cycle's decisions in one transaction: lock their nodes and read them as they
    are now (LiveCards), bind the single tasks (bind_singles) and then each task group
    whole or not at all (bind_groups), and write the ledger rows of every winner
    (write_ledger). A task group's members' TaskReq are in `tasks`."""
    members = [d for g in groups for d in g.decisions]
    if not decisions and not members:
        return BindOutcome()
    check_transition(TRANSITIONS, [S.PENDING], S.SCHEDULED)  # before any lock is taken
    with transaction.atomic():
        live = LiveCards.read({d.node_id for d in (*decisions, *members)}, settings or PluginSettings())
        now = utcnow()
        bound = bind_singles(decisions, tasks, may_share, live, now)
        if groups:
            bind_groups(groups, tasks, may_share, live, now, bound)
        write_ledger(bound, tasks, now)
    won = {d.task_id for d in bound.decisions}
    every = [*decisions, *members]
    on = {d.task_id: d.node_id for d in decisions if d.task_id in bound.refused}
    return BindOutcome(
        [d.task_id for d in every if d.task_id in won],
        [d.task_id for d in every if d.task_id not in won],
        bound.refused,
        {node_id: live.found(node_id) for node_id in sorted(set(on.values()))},
    )


def bind_singles(decisions: list[Decision], tasks: dict[int, TaskReq], may_share, live: LiveCards, now) -> Bound:
    """The single tasks: drop the decisions the live rows now contradict (a node gone, a
    card taken, a holder this tenant may not share with); plan each memory-only task's
    slice on its card as it is now (one that cannot be planned, no MIG profile left,
    drops its decision and the task keeps waiting with the reason); give the inference
    tasks a host port (one whose node has none left drops); move the rest pending →
    scheduled in one multi-row compare-and-set, and carve the winners' slices (with the
    agent's create requests)."""
    refused = {}
    still_valid = []
    for d in decisions:
        why = live.refusal(d, tasks[d.task_id], may_share)
        if why is None:
            still_valid.append(d)
        else:
            refused[d.task_id] = why
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
    unplannable = {task_id: plan for task_id, plan in carves.items() if isinstance(plan, Refusal)}
    if unplannable:
        still_valid = [d for d in still_valid if d.task_id not in unplannable]
        explain_refusals(unplannable, now)
    ports = assign_host_ports(still_valid, tasks, live.alive)
    still_valid = [d for d in still_valid if d.task_id in ports]
    rows = bind_rows(still_valid, ports, now)
    won = {row[0] for row in rows}
    winners = [d for d in still_valid if d.task_id in won]
    planned = {d.task_id: carves[d.task_id] for d in winners if d.task_id in carves}
    slice_ledger.carve(list(planned.values()), now)
    return Bound(winners, rows, planned, refused)


def bind_groups(
    groups: Sequence[GroupDecision], tasks: dict[int, TaskReq], may_share, live: LiveCards, now, bound: Bound
) -> None:
    """Each task group whole or not at all, after the singles (`bound`, which it adds to):
    one contradicted member drops the group; the host ports every holding group wants (a
    training group's master, each member of an inference group) in one look at the ports
    in use, the singles' included (a group short of one is dropped); then its members'
    compare-and-set in a savepoint of its own, rolled back unless every member won, and
    the bound groups' attempt and network in one statement."""
    hosts = {
        node.pk: node
        for node in Node.objects.filter(pk__in={d.node_id for g in groups for d in g.decisions} & live.alive).only(
            *NETWORK_FIELDS
        )
    }
    policy = django_settings.HETEROFLOW_NETWORK_DOMAIN_POLICY
    holding = [g for g in groups if all(live.still_holds(d, tasks[d.task_id], may_share) for d in g.decisions)]
    wanted_by_group = {group.group_id: ports_wanted(group, tasks) for group in holding}
    wanted = [d for group_wanted in wanted_by_group.values() for d in group_wanted]
    all_ports = assign_host_ports(wanted, tasks, live.alive, wanted=wanted)
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
            bound.rows += rows
            bound.decisions += group.decisions
        else:  # a member was moved meanwhile: none of them is bound
            transaction.savepoint_rollback(savepoint)
    if networks:
        with connection.cursor() as cursor:
            cursor.execute(
                GROUPS_BOUND, [now, list(networks), [orjson.dumps(network).decode() for network in networks.values()]]
            )


def write_ledger(bound: Bound, tasks: dict[int, TaskReq], now) -> None:
    """The ledger rows of every winner, one per card (a share holds what is carved: a MIG
    slice its profile's memory), in one statement; and the bind's wait times for the
    metrics once the transaction commits."""
    transaction.on_commit(partial(metrics.record_binds, [float(row[1]) for row in bound.rows]))
    cards = [(d, index) for d in bound.decisions for index in d.gpu_indices]
    if not cards:
        return
    carves = bound.carves
    with connection.cursor() as cursor:
        cursor.execute(
            ALLOCATE,
            [
                now,
                [d.task_id for d, _ in cards],
                [d.node_id for d, _ in cards],
                [index for _, index in cards],
                [tasks[d.task_id].tenant_id for d, _ in cards],
                [carves[d.task_id].plan.memory_mb if d.task_id in carves else d.memory_mb for d, _ in cards],
            ],
        )


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


# why the last cycle did not place them (only still-pending tasks: a racer may have bound one)
EXPLAIN = """
    UPDATE tasks AS t SET schedule_reason = v.reason
    FROM unnest(%s::bigint[], %s::jsonb[]) AS v(id, reason)
    WHERE t.id = v.id AND t.status = 'pending'
"""
