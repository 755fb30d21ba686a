"""Notification channels end to end, minus the queue: alerts in the table → the dispatcher
→ deliveries → one attempt each, against a real HTTP receiver on 127.0.0.1 (it checks the
signature the way docs/alerts.md tells receivers to) and Django's mail backends (locmem,
and SMTP against a small real SMTP server). The job bodies run directly, as in the other
job tests; test_notification_delivery_live.py runs them through a real Celery worker
and runs two dispatchers at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.core import mail
from django.test import override_settings

from apps.alerts.choices import AlertScope, AlertState, AlertType, Severity
from apps.alerts.jobs import deliver_notification_job, dispatch_notifications_job
from apps.alerts.models import Alert, NotificationChannel, NotificationDelivery
from apps.alerts.notifications import channels as services
from apps.alerts.notifications.delivery import backoff_seconds, deliver, parse_retry_after
from apps.alerts.notifications.dispatch import dispatch_notifications, fan_out
from apps.alerts.services import raise_alert, recover_alert
from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.core.principals import Principal, PrincipalKind
from apps.tenants.choices import Role
from tests.alerts.receivers import HANG, start_http_receiver, start_smtp_server, stop_http_receiver, stop_smtp_server
from tests.factories import TaskFactory, make_alert
from tests.live import REPO, free_port

pytestmark = pytest.mark.django_db


@pytest.fixture
def receiver():
    receiver = start_http_receiver()
    yield receiver
    stop_http_receiver(receiver)


def operator(world) -> Principal:
    return Principal(PrincipalKind.OPERATOR, user=world.operator)


def admin_of(world, slug) -> Principal:
    return Principal(
        PrincipalKind.TENANT_USER, user=world.users[f"{slug}-admin"], tenant=world.tenants[slug], role=Role.ADMIN
    )


def webhook(world, url, *, tenant=None, name="hook", **options):
    principal = admin_of(world, tenant) if tenant else operator(world)
    tenant = world.tenants[tenant] if tenant else None
    return services.create_channel(principal=principal, tenant=tenant, name=name, kind="webhook", url=url, **options)


def node_alert(node="n1", severity=Severity.ERROR, type=AlertType.NODE_OFFLINE, tenant=None, scope=AlertScope.NODE):
    raise_alert(
        type=type,
        severity=severity,
        scope=scope,
        key=f"{type}:{node}",
        node_id=node,
        tenant_id=tenant.pk if tenant else None,
        message=f"Node {node} is quiet.",
    )
    return Alert.objects.get(key=f"{type}:{node}", state=AlertState.ACTIVE)


def task_alert(tenant, severity=Severity.ERROR, type=AlertType.TASK_FAILED):
    task = TaskFactory(tenant=tenant)
    raise_alert(
        type=type,
        severity=severity,
        scope=AlertScope.TASK,
        key=f"{type}:{task.pk}",
        task_id=task.pk,
        tenant_id=tenant.pk,
        message=f"Task {task.pk} failed.",
    )
    return Alert.objects.get(key=f"{type}:{task.pk}")


def delivered_alerts(channel, event="alert.raised") -> set[int]:
    return set(NotificationDelivery.objects.filter(channel=channel, event=event).values_list("alert_id", flat=True))


def only_delivery(channel) -> NotificationDelivery:
    return NotificationDelivery.objects.get(channel=channel)


# --- signing and the payload --------------------------------------------------------------


def test_a_webhook_delivery_is_signed_and_a_tampered_body_fails(world, receiver):
    created = webhook(world, receiver.url)
    alert = node_alert()
    result = dispatch_notifications()
    assert result.raised == 1 and len(result.deliveries) == 1

    assert deliver(result.deliveries[0]).outcome == "delivered"
    (request,) = receiver.received
    assert request.path == "/hooks/heteroflow?token=t0k3n-in-the-url"
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["X-HeteroFlow-Delivery"] == str(result.deliveries[0])
    assert request.headers["X-HeteroFlow-Event"] == "alert.raised"
    assert request.headers["X-HeteroFlow-Signature"].startswith("sha256=")
    assert request.verifies_with(created.secret)
    assert not request.verifies_with(created.secret, body=request.body.replace(b"NODE_OFFLINE", b"NODE_ONLINE!"))
    assert not request.verifies_with(created.secret, body=request.body + b" ")
    assert not request.verifies_with("not-the-secret")

    body = request.json
    assert body["event"] == "alert.raised" and body["delivery"] == result.deliveries[0]
    assert body["channel"] == {"id": created.channel.pk, "name": "hook"}
    assert body["alert"]["id"] == alert.pk and body["alert"]["type"] == "NODE_OFFLINE"
    assert body["alert"]["state"] == "ACTIVE" and body["alert"]["node_id"] == "n1" and body["alert"]["tenant"] is None
    assert body["sent_at"].startswith(str(utcnow().year))

    delivery = NotificationDelivery.objects.get(pk=result.deliveries[0])
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("delivered", 1, 200)
    channel = NotificationChannel.objects.get(pk=created.channel.pk)
    assert channel.last_success_at is not None and channel.consecutive_failures == 0


def test_a_rotated_secret_signs_from_then_on(world, receiver):
    created = webhook(world, receiver.url)
    node_alert("n1")
    deliver(dispatch_notifications().deliveries[0])
    new_secret = services.rotate_secret(created.channel, principal=operator(world))
    assert new_secret != created.secret
    node_alert("n2")
    deliver(dispatch_notifications().deliveries[0])
    first, second = receiver.received
    assert first.verifies_with(created.secret) and not first.verifies_with(new_secret)
    assert second.verifies_with(new_secret) and not second.verifies_with(created.secret)


# --- who gets what ------------------------------------------------------------------------


@override_settings(HETEROFLOW_NOTIFY_GROUP_AFTER=1000, HETEROFLOW_NOTIFY_PER_MINUTE=10_000)  # no storm limit here
def test_a_tenant_channel_gets_what_its_tenant_may_see_and_an_operator_channel_everything(world, receiver):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    acme_hook = webhook(world, receiver.url, tenant="acme", name="acme-hook").channel
    beta_hook = webhook(world, receiver.url, tenant="beta", name="beta-hook").channel
    ops_hook = webhook(world, receiver.url, name="ops-hook").channel

    acme_task = task_alert(acme)
    beta_task = task_alert(beta)
    quota = node_alert("acme-quota", type=AlertType.QUOTA_EXCEEDED, tenant=acme, scope=AlertScope.TENANT)
    offline = node_alert("n1")
    gpu = node_alert("n1:0", type=AlertType.GPU_LOST, scope=AlertScope.GPU)
    # a node alert that names a tenant (its task ran there) is still about a node
    acme_node = node_alert("n2", tenant=acme)
    # an alert written straight into the table, as the heartbeat writes GPU_LOST
    direct = make_alert(
        type=AlertType.GPU_LOST,
        severity=Severity.ERROR,
        scope=AlertScope.GPU,
        key="GPU_LOST:n3:1",
        node_id="n3",
        gpu_index=1,
        message="GPU 1 of node n3 is lost.",
    )

    dispatch_notifications()
    assert delivered_alerts(acme_hook) == {acme_task.pk, quota.pk}
    assert delivered_alerts(beta_hook) == {beta_task.pk}
    assert delivered_alerts(ops_hook) == {
        acme_task.pk,
        beta_task.pk,
        quota.pk,
        offline.pk,
        gpu.pk,
        acme_node.pk,
        direct.pk,
    }

    for delivery in NotificationDelivery.objects.filter(channel=acme_hook):
        assert deliver(delivery.pk).outcome == "delivered"
    assert sorted(r.json["alert"]["id"] for r in receiver.received) == sorted([acme_task.pk, quota.pk])
    assert {r.json["alert"]["tenant"] for r in receiver.received} == {"acme"}


def test_min_severity_and_types_filter_what_a_channel_gets(world, receiver):
    acme = world.tenants["acme"]
    errors_up = webhook(world, receiver.url, name="errors", min_severity="error").channel
    failures = webhook(world, receiver.url, name="failures", types=["TASK_FAILED"]).channel
    both = webhook(
        world, receiver.url, name="critical-failures", min_severity="critical", types=["TASK_FAILED"]
    ).channel

    warning = node_alert("n1", severity=Severity.WARNING)
    error = node_alert("n2", severity=Severity.ERROR)
    critical = node_alert("n3", severity=Severity.CRITICAL)
    failed = task_alert(acme, severity=Severity.ERROR)
    failed_critical = task_alert(acme, severity=Severity.CRITICAL)
    requeued = task_alert(acme, severity=Severity.CRITICAL, type=AlertType.TASK_REQUEUED)

    dispatch_notifications()
    assert warning.pk not in delivered_alerts(errors_up)
    assert delivered_alerts(errors_up) == {error.pk, critical.pk, failed.pk, failed_critical.pk, requeued.pk}
    assert delivered_alerts(failures) == {failed.pk, failed_critical.pk}
    assert delivered_alerts(both) == {failed_critical.pk}


def test_a_disabled_channel_gets_nothing_and_its_queued_deliveries_are_cancelled(world, receiver):
    created = webhook(world, receiver.url)
    node_alert("n1")
    queued = dispatch_notifications().deliveries
    services.update_channel(created.channel, principal=operator(world), enabled=False)
    node_alert("n2")
    assert dispatch_notifications().deliveries == []
    assert deliver(queued[0]).outcome == "cancelled"
    assert receiver.received == []
    assert NotificationDelivery.objects.get(pk=queued[0]).status == "cancelled"


# --- exactly once per channel ---------------------------------------------------------------


def test_dispatching_twice_makes_one_delivery_per_channel(world, receiver):
    one = webhook(world, receiver.url, name="one").channel
    two = webhook(world, receiver.url, name="two").channel
    alerts = [node_alert(f"n{i}") for i in range(5)]

    first = dispatch_notifications(batch_size=2)
    assert first.raised == 5 and len(first.deliveries) == 10  # three batches of at most two alerts
    second = dispatch_notifications()
    assert (second.raised, second.deliveries) == (0, [])
    for channel in (one, two):
        assert delivered_alerts(channel) == {alert.pk for alert in alerts}
    # even an alert offered again (say, a dispatcher that crashed after its claim) is not
    # delivered twice to a channel: one delivery per (alert, event, channel) in the table
    assert fan_out("alert.raised", [alerts[0].pk], utcnow()) == []
    assert NotificationDelivery.objects.count() == 10


def test_a_delivery_is_attempted_once_however_often_it_is_queued(world, receiver):
    webhook(world, receiver.url)
    node_alert()
    (delivery_id,) = dispatch_notifications().deliveries
    assert deliver(delivery_id).outcome == "delivered"
    assert deliver(delivery_id).outcome == "skipped"
    assert len(receiver.received) == 1


def test_raised_and_ended_between_two_ticks_both_go_out_raised_first(world, receiver):
    channel = webhook(world, receiver.url).channel
    alert = node_alert()
    recover_alert(alert.key)
    result = dispatch_notifications()
    assert (result.raised, result.ended) == (1, 1)
    raised, ended = NotificationDelivery.objects.filter(channel=channel).order_by("pk")
    assert (raised.event, ended.event) == ("alert.raised", "alert.ended")
    for delivery in (raised, ended):
        deliver(delivery.pk)
    assert [r.json["event"] for r in receiver.received] == ["alert.raised", "alert.ended"]


def test_alert_ended_goes_out_after_a_recovery_and_after_a_resolve(world, receiver):
    channel = webhook(world, receiver.url).channel
    recovering, resolved = node_alert("n1"), node_alert("n2")
    dispatch_notifications()
    assert dispatch_notifications().ended == 0  # still active: nothing ends

    recover_alert(recovering.key)
    Alert.objects.filter(pk=resolved.pk).update(
        state=AlertState.RESOLVED, ended_at=utcnow(), resolved_by=world.operator
    )
    result = dispatch_notifications()
    assert (result.raised, result.ended) == (0, 2)
    assert delivered_alerts(channel, "alert.ended") == {recovering.pk, resolved.pk}
    for delivery_id in result.deliveries:
        assert deliver(delivery_id).outcome == "delivered"
    states = {r.json["alert"]["id"]: (r.json["event"], r.json["alert"]["state"]) for r in receiver.received}
    assert states == {recovering.pk: ("alert.ended", "RECOVERED"), resolved.pk: ("alert.ended", "RESOLVED")}
    assert all(r.json["alert"]["ended_at"] for r in receiver.received)
    assert dispatch_notifications().ended == 0


# --- retries and failures ---------------------------------------------------------------------


def test_a_500_is_retried_with_back_off_then_delivered(world, receiver):
    created = webhook(world, receiver.url)
    node_alert()
    (delivery_id,) = dispatch_notifications().deliveries
    receiver.answer(500, 503)
    now = utcnow()

    first = deliver(delivery_id, now=now)
    assert first.outcome == "retry" and first.retry_in == backoff_seconds(1) == 10.0
    delivery = NotificationDelivery.objects.get(pk=delivery_id)
    assert (delivery.status, delivery.attempts, delivery.last_status_code, delivery.last_error) == (
        "pending",
        1,
        500,
        "HTTP 500",
    )
    assert delivery.next_attempt_at == now + timedelta(seconds=10)
    assert deliver(delivery_id, now=now + timedelta(seconds=5)).outcome == "skipped"  # not due yet

    second = deliver(delivery_id, now=now + timedelta(seconds=10))
    assert second.outcome == "retry" and second.retry_in == 20.0  # doubled
    third = deliver(delivery_id, now=now + timedelta(seconds=30))
    assert third.outcome == "delivered"

    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("delivered", 3, 200)
    assert len({r.headers["X-HeteroFlow-Delivery"] for r in receiver.received}) == 1 and len(receiver.received) == 3
    assert all(r.verifies_with(created.secret) for r in receiver.received)
    channel = NotificationChannel.objects.get(pk=created.channel.pk)
    assert channel.consecutive_failures == 0 and channel.last_failure_at is None


@override_settings(HETEROFLOW_NOTIFY_BACKOFF_MAX_SECONDS=300.0)
def test_408_and_429_are_retried_and_retry_after_is_honoured_up_to_the_cap(world, receiver):
    webhook(world, receiver.url)
    node_alert()
    (delivery_id,) = dispatch_notifications().deliveries
    receiver.answer((429, {"Retry-After": "120"}), (503, {"Retry-After": "86400"}), 408)
    now = utcnow()
    assert deliver(delivery_id, now=now).retry_in == 120.0  # more than the 10 s back-off: the receiver's wish
    assert deliver(delivery_id, now=now + timedelta(seconds=120)).retry_in == 300.0  # a day: capped
    assert deliver(delivery_id, now=now + timedelta(seconds=420)).retry_in == 40.0  # plain back-off again
    assert deliver(delivery_id, now=now + timedelta(seconds=460)).outcome == "delivered"


def test_retry_after_as_an_http_date():
    now = utcnow()
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=now) == 0.0  # in the past
    later = (now + timedelta(seconds=90)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert 88 <= parse_retry_after(later, now=now) <= 90
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


@pytest.mark.parametrize("status", [404, 400, 401, 410, 302])
def test_a_refusal_fails_at_once_and_is_recorded_on_the_channel(world, receiver, status):
    created = webhook(world, receiver.url)
    node_alert()
    (delivery_id,) = dispatch_notifications().deliveries
    receiver.answer((status, {"Location": "http://elsewhere.example/"}) if status == 302 else status)

    assert deliver(delivery_id).outcome == "failed"
    delivery = NotificationDelivery.objects.get(pk=delivery_id)
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("failed", 1, status)
    assert delivery.failed_at is not None and delivery.last_error.startswith(f"HTTP {status}")
    channel = NotificationChannel.objects.get(pk=created.channel.pk)
    assert channel.consecutive_failures == 1 and channel.last_failure_at == delivery.failed_at
    assert channel.last_error.startswith(f"HTTP {status}")
    assert len(receiver.received) == 1


@override_settings(HETEROFLOW_NOTIFY_MAX_ATTEMPTS=3)
def test_a_receiver_that_is_down_exhausts_the_attempts_and_fails_on_the_channel(world, receiver):
    url = f"http://127.0.0.1:{free_port()}/hook?token=sekrit-token"  # nobody listens there
    created = webhook(world, url)
    node_alert()
    (delivery_id,) = dispatch_notifications().deliveries
    now, outcomes = utcnow(), []
    for _ in range(5):  # more chances than attempts: the third must be the last
        attempt = deliver(delivery_id, now=now)
        outcomes.append(attempt.outcome)
        if attempt.retry_in is None:
            break
        now += timedelta(seconds=attempt.retry_in)
    assert outcomes == ["retry", "retry", "failed"]

    delivery = NotificationDelivery.objects.get(pk=delivery_id)
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("failed", 3, None)
    channel = NotificationChannel.objects.get(pk=created.channel.pk)
    assert channel.consecutive_failures == 1 and channel.last_failure_at is not None
    assert "could not connect" in channel.last_error and "gave up after 3 attempts" in channel.last_error
    assert "sekrit" not in channel.last_error and "127.0.0.1" not in channel.last_error  # no URL in errors
    assert deliver(delivery_id, now=now + timedelta(hours=1)).outcome == "skipped"  # finished for good

    # a later success resets the count
    node_alert("n2")
    services.update_channel(channel, principal=operator(world), url=receiver.url)
    (next_id,) = dispatch_notifications().deliveries
    assert deliver(next_id).outcome == "delivered"
    channel.refresh_from_db()
    assert channel.consecutive_failures == 0 and channel.last_error.startswith("could not connect")


@override_settings(HETEROFLOW_NOTIFY_TIMEOUT_SECONDS=0.5)
def test_the_time_out_is_honoured(world, receiver):
    webhook(world, receiver.url)
    node_alert()
    (delivery_id,) = dispatch_notifications().deliveries
    receiver.answer(HANG)
    started = time.monotonic()
    attempt = deliver(delivery_id)
    took = time.monotonic() - started
    assert attempt.outcome == "retry"
    assert 0.5 <= took < 5, took  # the receiver holds the request for 30 s
    assert NotificationDelivery.objects.get(pk=delivery_id).last_error == "no answer within 0.5 s"


@override_settings(HETEROFLOW_NOTIFY_ALLOW_PRIVATE_TARGETS=False)
def test_a_tenant_webhook_may_not_reach_private_addresses_unless_allowed(world, receiver):
    tenant_hook = webhook(world, receiver.url, tenant="acme").channel
    ops_hook = webhook(world, receiver.url).channel
    task_alert(world.tenants["acme"])
    dispatch_notifications()
    assert deliver(only_delivery(tenant_hook).pk).outcome == "failed"
    assert "non-public address" in NotificationChannel.objects.get(pk=tenant_hook.pk).last_error
    assert receiver.received == []
    assert deliver(only_delivery(ops_hook).pk).outcome == "delivered"  # operators are trusted with their network
    assert len(receiver.received) == 1


def test_a_deleted_channel_sends_nothing_queued_for_it(world, receiver):
    created = webhook(world, receiver.url)
    node_alert()
    (delivery_id,) = dispatch_notifications().deliveries
    services.delete_channel(created.channel, principal=operator(world))
    assert deliver(delivery_id).outcome == "skipped"
    assert receiver.received == []


# --- tests of a channel -------------------------------------------------------------------------


def test_a_test_delivery_is_signed_and_one_at_a_time(world, receiver):
    created = webhook(world, receiver.url, tenant="acme", enabled=False)  # a test works while disabled
    delivery = services.send_test(created.channel, principal=admin_of(world, "acme"))
    with pytest.raises(Conflict):
        services.send_test(created.channel, principal=admin_of(world, "acme"))
    assert deliver(delivery.pk).outcome == "delivered"
    (request,) = receiver.received
    assert request.verifies_with(created.secret)
    assert request.json["event"] == "test" and request.json["alert"] is None and "hook" in request.json["message"]
    assert services.send_test(created.channel, principal=admin_of(world, "acme")).pk != delivery.pk  # done: again


# --- e-mail ---------------------------------------------------------------------------------------


def email_channel(world, recipients=("oncall@example.test", "lead@example.test"), **options):
    created = services.create_channel(
        principal=operator(world), tenant=None, name="mail", kind="email", recipients=recipients, **options
    )
    assert created.secret is None and created.url == ""
    return created.channel


def test_an_email_channel_sends_through_djangos_mail_backend(world):
    channel = email_channel(world)
    alert = node_alert("n7", severity=Severity.CRITICAL)
    (delivery_id,) = dispatch_notifications().deliveries
    assert deliver(delivery_id).outcome == "delivered"

    (message,) = mail.outbox
    assert message.to == ["oncall@example.test", "lead@example.test"]
    assert message.subject == "[HeteroFlow] CRITICAL NODE_OFFLINE: Node n7 is quiet."
    assert message.from_email == "HeteroFlow <heteroflow@localhost>"
    assert "Node: n7" in message.body and f"delivery {delivery_id}" in message.body
    assert message.extra_headers["X-HeteroFlow-Event"] == "alert.raised"

    recover_alert(alert.key)
    (ended,) = dispatch_notifications().deliveries
    assert deliver(ended).outcome == "delivered"
    assert mail.outbox[-1].subject == "[HeteroFlow] Recovered: NODE_OFFLINE: Node n7 is quiet."
    assert NotificationChannel.objects.get(pk=channel.pk).last_success_at is not None


@pytest.mark.parametrize(
    ("reply", "outcome"),
    [("550 5.1.1 no such user", "failed"), ("451 4.3.0 try again later", "retry"), ("250 OK", "delivered")],
)
def test_an_smtp_server_refusing_fails_at_once_and_a_temporary_refusal_is_retried(world, reply, outcome):
    smtp = start_smtp_server(rcpt_reply=reply)
    try:
        with override_settings(
            EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend", EMAIL_HOST="127.0.0.1", EMAIL_PORT=smtp.port
        ):
            channel = email_channel(world, recipients=["nobody@example.test"])
            node_alert()
            (delivery_id,) = dispatch_notifications().deliveries
            assert deliver(delivery_id).outcome == outcome
    finally:
        stop_smtp_server(smtp)
    delivery = NotificationDelivery.objects.get(pk=delivery_id)
    channel.refresh_from_db()
    if outcome == "failed":
        assert delivery.last_error == "every recipient refused (SMTP 550)" and channel.consecutive_failures == 1
    elif outcome == "retry":
        assert delivery.status == "pending" and delivery.last_error == "every recipient refused (SMTP 451)"
        assert channel.consecutive_failures == 0
    else:
        assert len(smtp.messages) == 1 and b"Subject: [HeteroFlow] ERROR NODE_OFFLINE" in smtp.messages[0]


@override_settings(EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackend", EMAIL_HOST="127.0.0.1")
def test_an_unreachable_mail_server_is_retried(world):
    with override_settings(EMAIL_PORT=free_port()):
        email_channel(world)
        node_alert()
        (delivery_id,) = dispatch_notifications().deliveries
        attempt = deliver(delivery_id)
    assert attempt.outcome == "retry"
    assert NotificationDelivery.objects.get(pk=delivery_id).last_error.startswith("mail server unreachable")


# --- the jobs ---------------------------------------------------------------------------------------


def test_the_jobs_run_the_dispatcher_under_its_guard_and_deliver(world, receiver):
    created = webhook(world, receiver.url)
    node_alert()
    assert dispatch_notifications_job() == "ran"
    assert dispatch_notifications_job() == "early"  # within its 10 s period
    delivery = only_delivery(created.channel)
    assert deliver_notification_job(delivery.pk) == "delivered"
    assert deliver_notification_job(delivery.pk) == "skipped"
    assert len(receiver.received) == 1


def test_a_delivery_whose_queue_message_was_lost_is_queued_again(world, receiver):
    webhook(world, receiver.url)
    node_alert()
    now = utcnow()
    (delivery_id,) = dispatch_notifications(now=now).deliveries
    assert dispatch_notifications(now=now + timedelta(seconds=30)).requeued == []  # not overdue yet
    later = now + timedelta(seconds=61)
    assert dispatch_notifications(now=later).requeued == [delivery_id]
    assert dispatch_notifications(now=later + timedelta(seconds=10)).requeued == []  # once a minute at most
    assert deliver(delivery_id, now=later).outcome == "delivered"
    assert dispatch_notifications(now=later + timedelta(minutes=5)).requeued == []


# --- settings ------------------------------------------------------------------------------------


def read_settings(**env):
    """The settings module as a fresh process with `env` reads it."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HETEROFLOW_", "EMAIL_", "SECRET_KEY", "ALLOWED_HOSTS"))
    }
    code = (
        "import heteroflow.settings as s; print(s.EMAIL_BACKEND, s.HETEROFLOW_NOTIFY_ALLOW_PRIVATE_TARGETS, "
        "s.HETEROFLOW_NOTIFY_MAX_ATTEMPTS, s.DEFAULT_FROM_EMAIL)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, timeout=60, cwd=REPO
    )


def test_mail_and_notification_settings_come_from_the_environment():
    production = {
        "HETEROFLOW_ENV": "production",
        "SECRET_KEY": "k" * 60,
        "HETEROFLOW_AGENT_SECRET": "a" * 30,
        "ALLOWED_HOSTS": "hf.example.com",
    }
    dev = read_settings(HETEROFLOW_ENV="development")
    assert dev.stdout.split()[:3] == ["django.core.mail.backends.console.EmailBackend", "True", "8"], dev.stderr
    prod = read_settings(**production)
    assert prod.stdout.split()[:2] == ["django.core.mail.backends.smtp.EmailBackend", "False"], prod.stderr
    custom = read_settings(
        HETEROFLOW_EMAIL_BACKEND="SMTP",
        HETEROFLOW_NOTIFY_MAX_ATTEMPTS="3",
        DEFAULT_FROM_EMAIL="Alerts <alerts@example.test>",
    )
    assert custom.stdout.strip() == "django.core.mail.backends.smtp.EmailBackend True 3 Alerts <alerts@example.test>"
    for bad, named in (
        ({"EMAIL_USE_TLS": "true", "EMAIL_USE_SSL": "true"}, "EMAIL_USE_TLS and EMAIL_USE_SSL"),
        ({"HETEROFLOW_EMAIL_BACKEND": "carrier-pigeon"}, "HETEROFLOW_EMAIL_BACKEND"),
        ({"HETEROFLOW_NOTIFY_MAX_ATTEMPTS": "0"}, "HETEROFLOW_NOTIFY_MAX_ATTEMPTS"),
    ):
        refused = read_settings(**bad)
        assert refused.returncode != 0 and "ImproperlyConfigured" in refused.stderr and named in refused.stderr
