"""Raising and recovering alerts. Both are idempotent: the alerts table allows one
ACTIVE alert per key, so raising an active key does nothing, and recovering an alert
that is not active does nothing. (The heartbeat raises GPU_LOST inside its own single
statement, relying on the same index.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from apps.alerts.choices import AlertScope, AlertState, AlertType, Severity
from apps.alerts.models import Alert
from apps.core.clock import utcnow

RAISE_SQL = """
    INSERT INTO alerts (type, severity, scope, state, key, node_id, gpu_index, task_id, tenant_id, message, details,
                        created_at, updated_at)
    SELECT a.type, a.severity, a.scope, 'ACTIVE', a.key, a.node_id, a.gpu_index, a.task_id, a.tenant_id, a.message,
           a.details, now(), now()
    FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::int[], %s::bigint[], %s::bigint[],
                %s::text[], %s::jsonb[])
         AS a(type, severity, scope, key, node_id, gpu_index, task_id, tenant_id, message, details)
    ON CONFLICT (key) WHERE state = 'ACTIVE' DO NOTHING
    RETURNING key
"""


@dataclass(frozen=True)
class NewAlert:
    type: str
    severity: str
    scope: str
    key: str  # de-duplication: while an alert of this key is ACTIVE, raising it again does nothing
    message: str
    node_id: str = ""
    gpu_index: int | None = None
    task_id: int | None = None
    tenant_id: int | None = None
    details: dict = field(default_factory=dict)


def raise_alerts(alerts: list[NewAlert]) -> set[str]:
    """Raise many alerts in one statement (a sweep may raise a thousand at once).
    Returns the keys of the alerts newly created."""
    import json

    from django.db import connection

    if not alerts:
        return set()
    columns = [[] for _ in range(10)]
    for alert in {alert.key: alert for alert in alerts}.values():
        values = (str(alert.type), str(alert.severity), str(alert.scope), alert.key, alert.node_id, alert.gpu_index,
                  alert.task_id, alert.tenant_id, alert.message, json.dumps(alert.details))
        for column, value in zip(columns, values):
            column.append(value)
    with connection.cursor() as cursor:
        cursor.execute(RAISE_SQL, columns)
        return {key for (key,) in cursor.fetchall()}


def raise_alert(**fields) -> bool:
    """Returns whether a new alert was created."""
    return bool(raise_alerts([NewAlert(**fields)]))


def recover_alert(key: str) -> bool:
    now = utcnow()
    return bool(
        Alert.objects.filter(key=key, state=AlertState.ACTIVE).update(state=AlertState.RECOVERED, ended_at=now, updated_at=now)
    )


# --- the offline sweep ------------------------------------------------------------------

OFFLINE_SILENCE_SECONDS = 45


@dataclass
class SweepResult:
    offline: list[str] = field(default_factory=list)  # nodes found silent this pass (alert newly raised)
    recovered: list[str] = field(default_factory=list)
    requeued: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # stopping → stopped, draining → completed
    failed: list[int] = field(default_factory=list)  # no node alive anywhere: nothing to wait for


def sweep_offline_nodes(now=None) -> SweepResult:
    """Every 30 s, on every instance (each move is a CAS, so two sweeps cannot both move
    a task): a node silent for more than 45 s raises NODE_OFFLINE and its tasks are
    handled by state. running / scheduled / starting / waking go back to the queue (cards
    released, one event each); stopping ends as stopped and draining as completed;
    sleeping and preempting are left alone (the preemption watchdog owns the latter).
    When no node at all is alive, the tasks fail instead of waiting for a node that may
    never come. A node heard from again recovers its alert."""
    from django.db import transaction

    from apps.core.cas import transition
    from apps.nodes.models import Node
    from apps.scheduler.services import release
    from apps.tasks.choices import TRANSITIONS, TaskStatus as S
    from apps.tasks.models import Task
    from apps.tasks.services import record_event

    now = now or utcnow()
    cutoff = now - timedelta(seconds=OFFLINE_SILENCE_SECONDS)
    result = SweepResult()
    # (a node never heard from, registered by hand, has nothing to lose and raises nothing)
    silent = set(Node.objects.filter(last_heartbeat_at__lt=cutoff).values_list("pk", flat=True))
    alive = Node.objects.filter(last_heartbeat_at__gte=cutoff).values_list("pk", flat=True)
    for node_id in sorted(silent):
        if raise_alert(type=AlertType.NODE_OFFLINE, severity=Severity.ERROR, scope=AlertScope.NODE,
                       key=f"node-offline:{node_id}", node_id=node_id,
                       message=f"Node {node_id} has not sent a heartbeat for more than {OFFLINE_SILENCE_SECONDS} s."):
            result.offline.append(node_id)
    result.recovered = list(
        Alert.objects.filter(type=AlertType.NODE_OFFLINE, state=AlertState.ACTIVE, node_id__in=list(alive))
        .values_list("node_id", flat=True)
    )
    if result.recovered:
        Alert.objects.filter(type=AlertType.NODE_OFFLINE, state=AlertState.ACTIVE, node_id__in=result.recovered).update(
            state=AlertState.RECOVERED, ended_at=now, updated_at=now
        )
    if not silent:
        return result
    nobody_alive = not alive.exists()
    stranded = Task.objects.filter(node_id__in=silent)
    moves = [
        ((S.RUNNING, S.SCHEDULED, S.STARTING, S.WAKING), S.FAILED if nobody_alive else S.PENDING, "requeued"),
        ((S.STOPPING,), S.STOPPED, "finished"),
        ((S.DRAINING,), S.COMPLETED, "finished"),
    ]
    for sources, target, bucket in moves:
        candidates = list(stranded.filter(status__in=sources).values_list("pk", "node_id"))
        if not candidates:
            continue
        changes = {"node": None, "host_port": None} if target == S.PENDING else {"finished_at": now}
        if target == S.FAILED:
            changes["error_message"] = "its node went silent and no node in the cluster is alive"
        with transaction.atomic():
            moved = transition(Task, TRANSITIONS, [pk for pk, _ in candidates], sources, target, **changes)
            release(moved)
            nodes = dict(candidates)
            for task in Task.objects.filter(pk__in=moved):
                record_event(task, kind=f"node_lost_{target}", node_id=nodes[task.pk],
                             message=f"node {nodes[task.pk]} silent for more than {OFFLINE_SILENCE_SECONDS} s: {target}")
        (result.failed if target == S.FAILED else getattr(result, bucket)).extend(moved)
    return result


# --- people acting on alerts --------------------------------------------------------------

def acknowledge_alert(alert: Alert, user) -> bool:
    """Someone is looking at it. Only an ACTIVE, unacknowledged alert changes; asking
    again is not an error. Returns whether this call acknowledged it."""
    now = utcnow()
    done = Alert.objects.filter(pk=alert.pk, state=AlertState.ACTIVE, acknowledged_at__isnull=True).update(
        acknowledged_at=now, acknowledged_by=user, updated_at=now
    )
    alert.refresh_from_db()
    return bool(done)


def resolve_alert(alert: Alert, user) -> bool:
    """An operator (or a tenant admin, for their own alerts) closes it: ACTIVE →
    RESOLVED. An alert already ended stays as it ended. Returns whether this call
    resolved it. If the condition is still there, the next sweep or heartbeat raises a
    new alert: resolving hides nothing for long."""
    now = utcnow()
    done = Alert.objects.filter(pk=alert.pk, state=AlertState.ACTIVE).update(
        state=AlertState.RESOLVED, ended_at=now, resolved_by=user, updated_at=now
    )
    alert.refresh_from_db()
    return bool(done)
