"""Raising and recovering alerts. Both are idempotent: the alerts table allows one
ACTIVE alert per key, so raising an active key does nothing, and recovering an alert
that is not active does nothing. (The heartbeat raises GPU_LOST inside its own single
statement, relying on the same index.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import transaction

from apps.alerts.choices import AlertState, DeliveryStatus
from apps.alerts.models import Alert, NotificationDelivery
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
        values = (
            str(alert.type),
            str(alert.severity),
            str(alert.scope),
            alert.key,
            alert.node_id,
            alert.gpu_index,
            alert.task_id,
            alert.tenant_id,
            alert.message,
            json.dumps(alert.details),
        )
        for column, value in zip(columns, values, strict=True):
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
        Alert.objects.filter(key=key, state=AlertState.ACTIVE).update(
            state=AlertState.RECOVERED, ended_at=now, updated_at=now
        )
    )


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


# --- retention ------------------------------------------------------------------------------

PRUNE_BATCH = 2000
PRUNE_MAX_BATCHES = 10  # per run: at most 20,000 rows of each kind an hour


@dataclass
class Pruned:
    alerts: int = 0
    deliveries: int = 0


def prune(now=None) -> Pruned:
    """Delete what the retention settings let go of, in bounded batches: finished
    deliveries (delivered, failed, cancelled) older than HETEROFLOW_DELIVERY_RETENTION_DAYS,
    and ended alerts (resolved or recovered, both events dispatched) older than
    HETEROFLOW_ALERT_RETENTION_DAYS. An active alert, or a delivery still to be tried, is
    never deleted however old."""
    now = now or utcnow()
    result = Pruned()
    deliveries_before = now - timedelta(days=settings.HETEROFLOW_DELIVERY_RETENTION_DAYS)
    alerts_before = now - timedelta(days=settings.HETEROFLOW_ALERT_RETENTION_DAYS)
    finished = NotificationDelivery.objects.exclude(status=DeliveryStatus.PENDING).filter(
        created_at__lt=deliveries_before
    )
    ended = Alert.objects.exclude(state=AlertState.ACTIVE).filter(
        ended_at__lt=alerts_before, dispatched_raised_at__isnull=False, dispatched_ended_at__isnull=False
    )
    for query, field_name in ((finished, "deliveries"), (ended, "alerts")):
        for _ in range(PRUNE_MAX_BATCHES):
            with transaction.atomic():
                ids = list(query.order_by("pk").values_list("pk", flat=True)[:PRUNE_BATCH])
                if ids:
                    # deliveries keep their payload; their alert link goes (SET_NULL)
                    query.model.objects.filter(pk__in=ids).delete()
            setattr(result, field_name, getattr(result, field_name) + len(ids))
            if len(ids) < PRUNE_BATCH:
                break
    return result
