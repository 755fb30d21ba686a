"""Bind a cycle's decisions in one transaction: the nodes locked and the live cards read
(LiveCards), the singles moved pending → scheduled in one multi-row CAS and each task
group in a savepoint of its own (all its members or none), then the ledger rows."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from functools import partial

import orjson
from django.conf import settings as django_settings
from django.db import connection, transaction
from django.db.models import F, Q
from psycopg.types.json import Jsonb

from apps.core.cas import check_transition, compare_and_set
from apps.core.clock import utcnow
from apps.monitoring import metrics
from apps.nodes.models import Gpu, Node
from apps.nodes.network import same_network_domain
from apps.scheduler.core import (
    SCHEDULABLE_STATUSES,
    Decision,
    GroupDecision,
    PluginSettings,
    TaskReq,
)
from apps.scheduler.ledger import ALLOCATE
from apps.scheduler.models import GpuAllocation
from apps.slices import ledger as slice_ledger
from apps.slices.planning import Refusal
from apps.tasks.choices import HOLDING, TRANSITIONS, TaskKind
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task
from apps.tasks.ranks import network_decision

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


# why the last cycle did not place them (only still-pending tasks: a racer may have bound one)
EXPLAIN = """
    UPDATE tasks AS t SET schedule_reason = v.reason
    FROM unnest(%s::bigint[], %s::jsonb[]) AS v(id, reason)
    WHERE t.id = v.id AND t.status = 'pending'
"""
