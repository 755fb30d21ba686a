"""Preemption, the shell's half: the victims the core plans for are moved running →
preempting in one CAS (nothing is released until the agent confirms), and the watchdog
requeues what was not confirmed in time."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

from django.db import connection

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.services import raise_alert
from apps.core.clock import utcnow
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
