"""The outbox. Every ~10 s (alerts.dispatch_notifications) the dispatcher takes the
alerts whose "raised" or "ended" event has not been dispatched yet, in bounded batches,
each claimed with one `UPDATE … RETURNING` (rows another dispatcher holds are skipped,
rows it took are gone), and turns each into one delivery per matching channel; the
deliveries are queued for alerts.deliver_notification once the transaction commits.

An alert is never hooked at the place it is raised: the heartbeat raises GPU_LOST in its
own statement, so the table is the one place every alert passes through."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import connection, transaction
from django.db.models import Q

from apps.alerts.choices import SEVERITY_RANK, NotificationEvent
from apps.alerts.models import Alert, NotificationChannel
from apps.core.clock import utcnow
from apps.core.enqueue import enqueue
from apps.core.principals import Principal, PrincipalKind
from apps.tenants.choices import Role

BATCH_SIZE = 200
MAX_BATCHES = 5  # per event and run: at most 1,000 alerts of each event per tick
# A pending delivery this far past its time has lost its queue message (Redis holds
# nothing that cannot be lost): queue it again. A duplicate message finds it taken.
REQUEUE_AFTER = timedelta(seconds=60)
REQUEUE_LIMIT = 500

CLAIM = {
    NotificationEvent.RAISED: """
        UPDATE alerts SET dispatched_raised_at = %(now)s
        WHERE dispatched_raised_at IS NULL AND id IN (
            SELECT id FROM alerts WHERE dispatched_raised_at IS NULL
            ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
        RETURNING id
    """,
    # an alert raised and ended between two ticks gets both events, raised first
    NotificationEvent.ENDED: """
        UPDATE alerts SET dispatched_ended_at = %(now)s
        WHERE dispatched_ended_at IS NULL AND id IN (
            SELECT id FROM alerts
            WHERE dispatched_ended_at IS NULL AND state <> 'ACTIVE' AND dispatched_raised_at IS NOT NULL
            ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
        RETURNING id
    """,
}

INSERT_DELIVERIES = """
    INSERT INTO alert_deliveries (channel_id, alert_id, event, payload, status, attempts, next_attempt_at, last_error,
                                  created_at)
    SELECT d.channel_id, d.alert_id, %(event)s, d.payload, 'pending', 0, %(now)s, '', %(now)s
    FROM unnest(%(channels)s::bigint[], %(alerts)s::bigint[], %(payloads)s::jsonb[]) AS d(channel_id, alert_id, payload)
    ON CONFLICT (alert_id, event, channel_id) WHERE alert_id IS NOT NULL DO NOTHING
    RETURNING id
"""

REQUEUE = """
    UPDATE alert_deliveries SET next_attempt_at = %(now)s
    WHERE id IN (
        SELECT id FROM alert_deliveries
        WHERE status = 'pending' AND next_attempt_at < %(overdue)s AND (locked_until IS NULL OR locked_until < %(now)s)
        ORDER BY next_attempt_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
    RETURNING id
"""


@dataclass
class DispatchResult:
    raised: int = 0  # alerts whose "raised" event was taken
    ended: int = 0
    deliveries: list[int] = field(default_factory=list)  # created and queued
    requeued: list[int] = field(default_factory=list)  # overdue, queued again


def dispatch_notifications(now=None, *, batch_size: int = BATCH_SIZE, max_batches: int = MAX_BATCHES) -> DispatchResult:
    now = now or utcnow()
    result = DispatchResult()
    with transaction.atomic():
        for event in (NotificationEvent.RAISED, NotificationEvent.ENDED):
            for _ in range(max_batches):
                alert_ids = _claim(event, now, batch_size)
                if event == NotificationEvent.RAISED:
                    result.raised += len(alert_ids)
                else:
                    result.ended += len(alert_ids)
                result.deliveries += fan_out(event, alert_ids, now)
                if len(alert_ids) < batch_size:
                    break
        with connection.cursor() as cursor:
            cursor.execute(REQUEUE, {"now": now, "overdue": now - REQUEUE_AFTER, "limit": REQUEUE_LIMIT})
            result.requeued = sorted(pk for (pk,) in cursor.fetchall())
        for delivery_id in result.deliveries + result.requeued:
            enqueue("alerts.deliver_notification", delivery_id)
    return result


def _claim(event: str, now, limit: int) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(CLAIM[event], {"now": now, "limit": limit})
        return sorted(pk for (pk,) in cursor.fetchall())


def tenant_viewer(tenant) -> Principal:
    """Whom a tenant's channel stands for: what any of the tenant's people may see."""
    return Principal(PrincipalKind.TENANT_KEY, tenant=tenant, role=Role.VIEWER)


def passes_filters(channel: NotificationChannel, alert: Alert) -> bool:
    # a severity the ranks do not know (a newer writer) is sent rather than lost
    severity = SEVERITY_RANK.get(alert.severity, max(SEVERITY_RANK.values()))
    return severity >= SEVERITY_RANK[channel.min_severity] and (not channel.types or alert.type in channel.types)


def fan_out(event: str, alert_ids: list[int], now) -> list[int]:
    """One delivery per (alert, matching channel). A tenant's channel gets only what the
    tenant may see (Alert.objects.visible_to, the API's own rule); an operators' channel
    gets everything its filters let through."""
    if not alert_ids:
        return []
    alerts = list(Alert.objects.filter(pk__in=alert_ids).select_related("tenant").order_by("pk"))
    tenant_ids = {alert.tenant_id for alert in alerts if alert.tenant_id}
    channels = list(
        NotificationChannel.objects.filter(enabled=True)
        .filter(Q(tenant__isnull=True) | Q(tenant_id__in=tenant_ids))
        .select_related("tenant")
        .order_by("pk")
    )
    if not channels:
        return []
    visible = {}
    for channel in channels:
        if channel.tenant_id and channel.tenant_id not in visible:
            visible[channel.tenant_id] = set(
                Alert.objects.filter(pk__in=alert_ids)
                .visible_to(tenant_viewer(channel.tenant))
                .values_list("pk", flat=True)
            )
    columns = {"channels": [], "alerts": [], "payloads": []}
    for alert in alerts:
        payload = None
        for channel in channels:
            if channel.tenant_id and alert.pk not in visible[channel.tenant_id]:
                continue
            if not passes_filters(channel, alert):
                continue
            payload = payload or json.dumps({"alert": alert_payload(alert)})
            columns["channels"].append(channel.pk)
            columns["alerts"].append(alert.pk)
            columns["payloads"].append(payload)
    if not columns["channels"]:
        return []
    with connection.cursor() as cursor:
        cursor.execute(INSERT_DELIVERIES, {"event": str(event), "now": now, **columns})
        return sorted(pk for (pk,) in cursor.fetchall())


def _iso(moment) -> str | None:
    return moment.isoformat() if moment else None


def alert_payload(alert: Alert) -> dict:
    """The alert as the receiver sees it, taken when the event is dispatched."""
    return {
        "id": alert.pk,
        "type": alert.type,
        "severity": alert.severity,
        "scope": alert.scope,
        "state": alert.state,
        "key": alert.key,
        "message": alert.message,
        "details": alert.details,
        "node_id": alert.node_id or None,
        "gpu_index": alert.gpu_index,
        "task_id": alert.task_id,
        "tenant": alert.tenant.slug if alert.tenant_id else None,
        "created_at": _iso(alert.created_at),
        "ended_at": _iso(alert.ended_at),
    }
