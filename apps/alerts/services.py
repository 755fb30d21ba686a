"""Raising and recovering alerts. Both are idempotent: the alerts table allows one
ACTIVE alert per key, so raising an active key does nothing, and recovering an alert
that is not active does nothing. (The heartbeat raises GPU_LOST inside its own single
statement, relying on the same index.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from apps.alerts.choices import AlertState, AlertType, Severity
from apps.alerts.models import Alert
from apps.core.clock import utcnow

RAISE_SQL = """
    INSERT INTO alerts (type, severity, state, key, node_id, gpu_index, tenant_id, message, details, created_at, updated_at)
    VALUES (%s, %s, 'ACTIVE', %s, %s, %s, %s, %s, %s::jsonb, now(), now())
    ON CONFLICT (key) WHERE state = 'ACTIVE' DO NOTHING
"""


def raise_alert(*, type, severity, key, message, node_id="", gpu_index=None, tenant_id=None, details=None) -> bool:
    """Returns whether a new alert was created."""
    import json

    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(RAISE_SQL, [str(type), str(severity), key, node_id, gpu_index, tenant_id, message, json.dumps(details or {})])
        return cursor.rowcount == 1


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
        if raise_alert(type=AlertType.NODE_OFFLINE, severity=Severity.ERROR, key=f"node-offline:{node_id}", node_id=node_id,
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
