"""Preemption, the shell's half: the victims the core plans for are moved running →
preempting in one CAS (nothing is released until the agent confirms), and the watchdog
requeues what was not confirmed in time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta

from django.db import connection

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.services import raise_alert
from apps.core.clock import utcnow
from apps.monitoring import metrics
from apps.scheduler.core import (
    VICTIM_STATUSES,
    Failure,
    NodeSnap,
    Occupant,
    PluginSettings,
    PreemptionPlan,
    TaskReq,
    occupants_by_node,
    plan_preemption,
)
from apps.scheduler.core.queues import QueueBook, Work, reclaim_order
from apps.scheduler.ledger import card_share_sql
from apps.tasks.choices import TaskKind
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task
from apps.tasks.services import move_tasks, requeue_preempted

# Failures that may be answered by preemption, at placement or at bind (a decision whose
# node no longer takes work, or whose cards were taken meanwhile: apps.scheduler.bind's
# NODE_GONE and CARDS_GONE). A tenant-sharing failure is not: evicting another tenant's
# task to share its card would defeat the sharing rule.
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
    failures: list[Failure],
    tasks: dict[int, TaskReq],
    nodes: list[NodeSnap],
    settings: PluginSettings,
    may_share,
    siblings: Mapping[int, Mapping[str, int]] | None = None,
) -> dict[int, PreemptionPlan]:
    """The preempt plugin, after placement and bind: for each task that did not fit, or
    whose decision bind refused because its node had changed (in queue order, each
    once), plan the minimal eviction, then move every planned victim running →
    preempting in one CAS. Nothing is released here: the cards stay counted until the
    agent confirms the stop (or the watchdog forces it). `siblings`: the services'
    replicas by node as placement left them (a replica's plan keeps its anti-affinity)."""
    hopeful = [f for f in failures if f.code in PREEMPTION_TRIGGERS and tasks[f.task_id].kind != TaskKind.TRAINING]
    if not hopeful or settings.preempt_stage not in VICTIM_STATUSES or settings.preempt_stage == "disabled":
        return {}
    by_node = occupants_by_node(load_occupants(settings.preempt_stage))
    if not by_node:
        return {}
    plans: dict[int, PreemptionPlan] = {}
    taken: set[int] = set()
    for failure in hopeful:
        task = tasks[failure.task_id]
        apart = (siblings or {}).get(task.replica_of) if task.replica_of is not None else None
        plan = plan_preemption(task, nodes, by_node, settings, may_share, taken, apart)
        if plan is not None:
            plans[plan.task_id] = plan
            taken.update(plan.victims)
    if taken:
        won = set(preempt(taken, VICTIM_STATUSES[settings.preempt_stage]))
        for plan in plans.values():
            plan.victims = [victim for victim in plan.victims if victim in won]
    return plans


# A queue's reclaim (docs/queues.md): the cohort's borrowed work on the cards it holds,
# single tasks only (a group's members are stopped with their group, not one by one).
RECLAIMABLE_SQL = f"""
    SELECT t.id, t.tenant_id, lower(g.vendor), sum({card_share_sql("a", "g")}), t.priority,
           extract(epoch FROM COALESCE(t.running_since, t.created_at)), t.node_id, t.status, t.kind, t.preemptible
    FROM gpu_allocations AS a JOIN gpus AS g ON g.node_id = a.node_id AND g.index = a.gpu_index
    JOIN tasks AS t ON t.id = a.task_id
    WHERE a.tenant_id = ANY(%s) AND t.status = ANY(%s)
    GROUP BY t.id, t.tenant_id, lower(g.vendor), t.priority, t.running_since, t.created_at, t.node_id, t.status,
             t.kind, t.preemptible
"""


def reclaim_for(
    failures: list[Failure],
    tasks: dict[int, TaskReq],
    nodes: list[NodeSnap],
    settings: PluginSettings,
    may_share,
    book: QueueBook,
    planned: Mapping[int, PreemptionPlan],
) -> dict[int, PreemptionPlan]:
    """A queue's reclaim, after the preempt plugin: for each single task that found no
    room, keeps its tenant within nominal, and whose cohort borrows its type, the fewest
    of the cohort's borrowed tasks (core.queues.reclaim_order) whose stop makes room on
    one node, planned like a preemption and stopped the same graceful way. Each victim
    says who reclaimed it. Tasks the preempt plugin planned for already are left alone."""
    hopeful = [
        failure
        for failure in failures
        if failure.code in PREEMPTION_TRIGGERS and failure.task_id in tasks and failure.task_id not in planned
    ]
    if not hopeful or not book.cohorts:
        return {}
    members = sorted({spec.tenant_id for specs in book.cohorts.values() for spec in specs})
    with connection.cursor() as cursor:
        cursor.execute(RECLAIMABLE_SQL, [members, sorted(VICTIM_STATUSES["scheduled"])])
        rows = cursor.fetchall()
    works = [Work(row[0], row[1], row[2], float(row[3]), row[4], float(row[5])) for row in rows]
    occupants = {
        id: Occupant(id, node_id, status, kind, preemptible, priority, float(at))
        for id, _, _, _, priority, at, node_id, status, kind, preemptible in rows
    }
    plans: dict[int, PreemptionPlan] = {}
    taken = {victim for plan in planned.values() for victim in plan.victims}
    for failure in hopeful:
        task = tasks[failure.task_id]
        for gpu_type in [task.gpu_type] if task.gpu_type else sorted({work.gpu_type for work in works}):
            if not book.may_reclaim(task.tenant_id, gpu_type, float(task.gpu_required)):
                continue
            order = [work.id for work in reclaim_order(book, task.tenant_id, gpu_type, works) if work.id not in taken]
            by_node = occupants_by_node([occupants[work_id] for work_id in order])
            plan = plan_preemption(
                replace(task, gpu_type=gpu_type), nodes, by_node, settings, may_share, taken, reclaim=frozenset(order)
            )
            if plan is None or not plan.victims:
                continue
            by = book.specs[task.tenant_id].name
            won = move_tasks(
                sorted(plan.victims),
                sorted(VICTIM_STATUSES["scheduled"]),
                S.PREEMPTING,
                schedule_reason={"code": "Reclaimed", "message": f"reclaimed by {by} (its nominal)", "by": by},
            )
            plan.victims = [victim for victim in plan.victims if victim in set(won)]
            metrics.record_reclaims(by, len(plan.victims))
            for victim in plan.victims:
                work = next(work for work in works if work.id == victim)
                book.give_back(work.tenant_id, work.gpu_type, work.cards)
            taken.update(plan.victims)
            plans[plan.task_id] = plan
            break
    return plans


ON_A_NODE = frozenset({S.SCHEDULED, S.STARTING, S.RUNNING})


def preempt(task_ids, from_statuses=ON_A_NODE) -> list[int]:
    """The graceful stop, one CAS for every task: each moves to preempting (the ones
    still in `from_statuses`; returned); its agent sends the checkpoint signal, waits out
    the grace period and confirms, which requeues it; an agent that does not confirm in
    PREEMPTION_GRACE is overruled by the watchdog. The cards stay counted until then.
    The preempt plugin's victims and a borrowed training's reclaim
    (apps.inference.lending) both go this way."""
    return move_tasks(sorted(task_ids), sorted(from_statuses), S.PREEMPTING)


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
