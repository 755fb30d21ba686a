"""The outbox. Every ~10 s (alerts.dispatch_notifications) the dispatcher takes the
alerts whose "raised" or "ended" event has not been dispatched yet, in bounded batches,
each claimed with one `UPDATE … RETURNING` (rows another dispatcher holds are skipped,
rows it took are gone), and turns each into one delivery per matching channel; the
deliveries are queued for alerts.deliver_notification once the transaction commits.
A storm is grouped: past a few alerts per channel in one run (or past the channel's
minute budget) the rest of that run's alerts go to the channel as one digest
(`StormBudget`, `digest_payload`).

An alert is never hooked at the place it is raised: the heartbeat raises GPU_LOST in its
own statement, so the table is the one place every alert passes through."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
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
        budget = StormBudget(now)  # one per run: the storm limit counts the whole run
        for event in (NotificationEvent.RAISED, NotificationEvent.ENDED):
            for _ in range(max_batches):
                alert_ids = _claim(event, now, batch_size)
                if event == NotificationEvent.RAISED:
                    result.raised += len(alert_ids)
                else:
                    result.ended += len(alert_ids)
                result.deliveries += fan_out(event, alert_ids, now, budget)
                if len(alert_ids) < batch_size:
                    break
            result.deliveries += budget.send_digests(event)
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


def fan_out(event: str, alert_ids: list[int], now, budget: StormBudget | None = None) -> list[int]:
    """One delivery per (alert, matching channel), within the storm limit (`budget`; the
    alerts past it wait in the budget for the run's digest). A tenant's channel gets only
    what the tenant may see (Alert.objects.visible_to, the API's own rule); an operators'
    channel gets everything its filters let through."""
    if budget is None:  # a call on its own is a run of its own
        budget = StormBudget(now)
        return fan_out(event, alert_ids, now, budget) + budget.send_digests(event)
    if not alert_ids or not NotificationChannel.objects.filter(enabled=True).exists():
        return []  # nobody listens: the alerts are claimed (dispatched) and nothing is built
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
    per_channel: dict[int, list[Alert]] = {channel.pk: [] for channel in channels}
    for alert in alerts:
        for channel in channels:
            if channel.tenant_id and alert.pk not in visible[channel.tenant_id]:
                continue
            if not passes_filters(channel, alert):
                continue
            per_channel[channel.pk].append(alert)
    columns = {"channels": [], "alerts": [], "payloads": []}
    for channel_id, alone in budget.split(event, per_channel).items():
        for alert in alone:
            columns["channels"].append(channel_id)
            columns["alerts"].append(alert.pk)
            columns["payloads"].append(json.dumps({"alert": budget.payload(alert)}))
    if not columns["channels"]:
        return []
    with connection.cursor() as cursor:
        cursor.execute(INSERT_DELIVERIES, {"event": str(event), "now": now, **columns})
        return sorted(pk for (pk,) in cursor.fetchall())


# --- the storm limit ----------------------------------------------------------------------

SENT_LAST_MINUTE = """
    SELECT channel_id, count(*) FROM alert_deliveries
    WHERE channel_id = ANY(%(channels)s) AND created_at > %(since)s AND event <> 'test'
    GROUP BY channel_id
"""

INSERT_DIGESTS = """
    INSERT INTO alert_deliveries (channel_id, alert_id, event, payload, status, attempts, next_attempt_at, last_error,
                                  created_at)
    SELECT d.channel_id, NULL, %(event)s, d.payload, 'pending', 0, %(now)s, '', %(now)s
    FROM unnest(%(channels)s::bigint[], %(payloads)s::jsonb[]) AS d(channel_id, payload)
    RETURNING id
"""


class StormBudget:
    """The storm limit of one dispatch run. Per channel: at most
    HETEROFLOW_NOTIFY_GROUP_AFTER alerts one by one in the run, and within
    HETEROFLOW_NOTIFY_PER_MINUTE deliveries a minute (digests count, one place kept for
    the digest); the rest of the run's alerts of each event go to the channel as one
    digest, so a storm of 1,000 alerts is a handful of messages per channel, not 1,000."""

    def __init__(self, now):
        self.now = now
        self.left: dict[int, int] = {}  # channel -> alerts it may still get one by one
        self.grouped: dict[tuple[int, str], list[Alert]] = {}
        self.shown: dict[int, dict] = {}  # alert id -> its payload, built once

    def split(self, event: str, per_channel: dict[int, list[Alert]]) -> dict[int, list[Alert]]:
        """The alerts each channel gets one by one; the others are kept for the digest."""
        fresh = [pk for pk, matched in per_channel.items() if matched and pk not in self.left]
        if fresh:
            with connection.cursor() as cursor:
                cursor.execute(SENT_LAST_MINUTE, {"channels": fresh, "since": self.now - timedelta(seconds=60)})
                sent = dict(cursor.fetchall())
            per_run, per_minute = settings.HETEROFLOW_NOTIFY_GROUP_AFTER, settings.HETEROFLOW_NOTIFY_PER_MINUTE
            for pk in fresh:
                self.left[pk] = max(0, min(per_run, per_minute - 1 - sent.get(pk, 0)))
        alone = {}
        for pk, matched in per_channel.items():
            take = self.left.get(pk, 0)
            alone[pk], rest = matched[:take], matched[take:]
            self.left[pk] = take - len(alone[pk])
            if rest:
                self.grouped.setdefault((pk, event), []).extend(rest)
        return alone

    def payload(self, alert: Alert) -> dict:
        if alert.pk not in self.shown:
            self.shown[alert.pk] = alert_payload(alert)
        return self.shown[alert.pk]

    def send_digests(self, event: str) -> list[int]:
        """One digest per channel for the alerts of `event` kept back in this run."""
        waiting = [(pk, alerts) for (pk, kind), alerts in self.grouped.items() if kind == event]
        for pk, _ in waiting:
            del self.grouped[(pk, event)]
        if not waiting:
            return []
        with connection.cursor() as cursor:
            cursor.execute(
                INSERT_DIGESTS,
                {
                    "event": str(event),
                    "now": self.now,
                    "channels": [pk for pk, _ in waiting],
                    "payloads": [json.dumps(digest_payload(alerts, self.payload)) for _, alerts in waiting],
                },
            )
            return sorted(pk for (pk,) in cursor.fetchall())


def digest_payload(alerts: list[Alert], payload_of) -> dict:
    """Many alerts of one event in one message: how many, the first of them in full (up to
    HETEROFLOW_NOTIFY_DIGEST_LISTED), and how many of each type."""
    listed = alerts[: settings.HETEROFLOW_NOTIFY_DIGEST_LISTED]
    types: dict[str, int] = {}
    for alert in alerts:
        types[alert.type] = types.get(alert.type, 0) + 1
    return {
        "alert": None,
        "digest": {
            "count": len(alerts),
            "types": types,
            "alerts": [payload_of(alert) for alert in listed],
            "omitted": len(alerts) - len(listed),
        },
    }


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
