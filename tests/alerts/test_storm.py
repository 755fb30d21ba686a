"""Notification storms and retention (docs/alerts.md#storms): 1,000 node alerts in one
dispatch are a handful of messages per channel, not 1,000 (the first few one by one, the
rest in one digest), a channel's minute budget holds across runs, the digest reaches a
real receiver and an e-mail inbox, and the hourly prune deletes only what retention lets
go of."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core import mail
from django.test import override_settings

from apps.alerts.choices import AlertScope, AlertState, AlertType, DeliveryStatus, NotificationEvent, Severity
from apps.alerts.models import Alert, NotificationDelivery
from apps.alerts.notifications import channels as services
from apps.alerts.notifications.delivery import deliver, email_text
from apps.alerts.notifications.dispatch import dispatch_notifications
from apps.alerts.services import NewAlert, prune, raise_alerts
from apps.core.clock import utcnow
from apps.core.principals import Principal, PrincipalKind
from tests.alerts.receivers import start_http_receiver, stop_http_receiver
from tests.factories import make_alert

pytestmark = pytest.mark.django_db


def operator(world) -> Principal:
    return Principal(PrincipalKind.OPERATOR, user=world.operator)


def storm(n: int, prefix: str = "rack") -> None:
    raise_alerts(
        [
            NewAlert(
                type=AlertType.NODE_OFFLINE,
                severity=Severity.ERROR,
                scope=AlertScope.NODE,
                key=f"NODE_OFFLINE:{prefix}-{i}",
                node_id=f"{prefix}-{i}",
                message=f"Node {prefix}-{i} is quiet.",
            )
            for i in range(n)
        ]
    )


@override_settings(HETEROFLOW_NOTIFY_GROUP_AFTER=5, HETEROFLOW_NOTIFY_PER_MINUTE=30, HETEROFLOW_NOTIFY_DIGEST_LISTED=50)
def test_a_storm_of_1000_alerts_is_five_messages_and_one_digest_per_channel(world):
    hook = services.create_channel(
        principal=operator(world), tenant=None, name="hook", kind="webhook", url="http://127.0.0.1:9/hook"
    ).channel
    inbox = services.create_channel(
        principal=operator(world), tenant=None, name="mail", kind="email", recipients=["ops@example.com"]
    ).channel
    storm(1000)
    result = dispatch_notifications()
    assert result.raised == 1000
    for channel in (hook, inbox):
        rows = list(NotificationDelivery.objects.filter(channel=channel).order_by("pk"))
        assert len(rows) == 6
        alone, digest = rows[:5], rows[5]
        assert all(row.alert_id and row.payload["alert"]["type"] == "NODE_OFFLINE" for row in alone)
        assert digest.alert_id is None and digest.event == NotificationEvent.RAISED
        summary = digest.payload["digest"]
        assert summary["count"] == 995 and summary["types"] == {"NODE_OFFLINE": 995}
        assert len(summary["alerts"]) == 50 and summary["omitted"] == 945
        # the digest names alerts the single messages did not
        assert not {a["id"] for a in summary["alerts"]} & {row.alert_id for row in alone}
    subject, text = email_text(inbox, NotificationDelivery.objects.filter(channel=inbox, alert=None).get())
    assert subject.endswith("995 alerts raised: 995 NODE_OFFLINE")
    assert "… and 945 more" in text
    # the storm ends: one digest of the ended events, the first five alone
    Alert.objects.update(state=AlertState.RECOVERED, ended_at=utcnow())
    ended = dispatch_notifications()
    assert ended.ended == 1000
    assert NotificationDelivery.objects.filter(channel=hook, event=NotificationEvent.ENDED).count() == 6


@override_settings(HETEROFLOW_NOTIFY_GROUP_AFTER=5, HETEROFLOW_NOTIFY_PER_MINUTE=8)
def test_the_minute_budget_holds_across_runs(world):
    hook = services.create_channel(
        principal=operator(world), tenant=None, name="hook", kind="webhook", url="http://127.0.0.1:9/hook"
    ).channel
    now = utcnow()
    storm(3, "a")
    dispatch_notifications(now)  # 3 alone: under both limits
    storm(10, "b")
    dispatch_notifications(now + timedelta(seconds=10))  # 8 - 1 - 3 = 4 alone, 6 in a digest
    storm(10, "c")
    dispatch_notifications(now + timedelta(seconds=20))  # the minute's budget is spent: all in a digest
    rows = list(NotificationDelivery.objects.filter(channel=hook).order_by("pk"))
    assert [row.alert_id is None for row in rows] == [False] * 3 + [False] * 4 + [True] + [True]
    assert [row.payload["digest"]["count"] for row in rows if row.alert_id is None] == [6, 10]
    storm(2, "d")
    dispatch_notifications(now + timedelta(seconds=90))  # a new minute: one by one again
    assert NotificationDelivery.objects.filter(channel=hook, alert__node_id__startswith="d-").count() == 2


@override_settings(HETEROFLOW_NOTIFY_GROUP_AFTER=1)
def test_the_digest_reaches_a_real_receiver(world):
    receiver = start_http_receiver()
    try:
        hook = services.create_channel(
            principal=operator(world), tenant=None, name="hook", kind="webhook", url=receiver.url
        ).channel
        storm(4)
        dispatch_notifications()
        digest = NotificationDelivery.objects.get(channel=hook, alert=None)
        attempt = deliver(digest.pk)
        assert attempt.outcome == "delivered", attempt
        body = receiver.received[-1].json
        assert body["event"] == "alert.raised" and body["alert"] is None
        assert body["digest"]["count"] == 3 and len(body["digest"]["alerts"]) == 3
    finally:
        stop_http_receiver(receiver)


@override_settings(HETEROFLOW_ALERT_RETENTION_DAYS=30, HETEROFLOW_DELIVERY_RETENTION_DAYS=7)
def test_prune_deletes_only_what_retention_lets_go(world):
    hook = services.create_channel(
        principal=operator(world), tenant=None, name="hook", kind="webhook", url="http://127.0.0.1:9/hook"
    ).channel
    now = utcnow()
    long_ago, lately = now - timedelta(days=40), now - timedelta(days=2)
    dispatched = {"dispatched_raised_at": long_ago, "dispatched_ended_at": long_ago}
    old_ended = make_alert(key="old", state=AlertState.RECOVERED, ended_at=long_ago, **dispatched)
    recent_ended = make_alert(key="recent", state=AlertState.RESOLVED, ended_at=lately, **dispatched)
    still_active = make_alert(key="active", state=AlertState.ACTIVE, dispatched_raised_at=long_ago)
    undispatched = make_alert(key="undispatched", state=AlertState.RECOVERED, ended_at=long_ago)

    def delivery(status, created, alert=None):
        row = NotificationDelivery.objects.create(
            channel=hook, alert=alert, event="alert.raised", payload={"alert": None}, status=status
        )
        NotificationDelivery.objects.filter(pk=row.pk).update(created_at=created)
        return row.pk

    [delivery(DeliveryStatus.DELIVERED, long_ago), delivery(DeliveryStatus.FAILED, long_ago)]
    kept = [
        delivery(DeliveryStatus.PENDING, long_ago),  # still to be tried
        delivery(DeliveryStatus.DELIVERED, lately, alert=old_ended),  # recent: kept, loses its alert link
    ]
    result = prune(now)
    assert (result.alerts, result.deliveries) == (1, 2)
    assert set(Alert.objects.values_list("pk", flat=True)) == {recent_ended.pk, still_active.pk, undispatched.pk}
    assert set(NotificationDelivery.objects.values_list("pk", flat=True)) == set(kept)
    assert NotificationDelivery.objects.get(pk=kept[1]).alert_id is None
    assert not mail.outbox
    assert prune(now) == type(result)()  # nothing more to do
