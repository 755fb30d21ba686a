"""Notifications with real concurrency and a real queue: two dispatchers on their own
connections at once, and a real Celery worker (in a thread, on this run's Redis) taking
the deliveries the dispatcher and the API queue after commit, retrying through the
broker. Committed rows are needed, hence transaction=True in a module of its own."""

from __future__ import annotations

import threading

import pytest
from celery.contrib.testing.worker import start_worker
from django.db import connection
from django.test import override_settings

from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.jobs import dispatch_notifications_job
from apps.alerts.models import NotificationDelivery
from apps.alerts.notifications import channels as services
from apps.alerts.notifications.dispatch import dispatch_notifications
from apps.alerts.services import NewAlert, raise_alert, raise_alerts
from apps.core.principals import Principal, PrincipalKind
from apps.tenants.services import issue_platform_key
from celery_worker import app as celery_app
from tests.alerts.receivers import start_http_receiver, stop_http_receiver
from tests.factories import OperatorFactory
from tests.headers import bearer
from tests.live import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def receiver():
    receiver = start_http_receiver()
    yield receiver
    stop_http_receiver(receiver)


@pytest.fixture
def operator():
    return Principal(PrincipalKind.OPERATOR, user=OperatorFactory(username="live-op"))


@pytest.fixture
def worker():
    """A Celery worker consuming this run's broker (REDIS_URL), emptied first of what
    earlier tests queued and nobody consumed."""
    celery_app.control.purge()
    with start_worker(celery_app, pool="solo", perform_ping_check=False, shutdown_timeout=10, loglevel="WARNING"):
        yield
    celery_app.control.purge()


@override_settings(HETEROFLOW_NOTIFY_GROUP_AFTER=1000, HETEROFLOW_NOTIFY_PER_MINUTE=10_000)  # no storm limit here
def test_two_dispatchers_at_once_make_exactly_one_delivery_per_alert_and_channel(receiver, operator):
    for name in ("one", "two"):
        services.create_channel(principal=operator, tenant=None, name=name, kind="webhook", url=receiver.url)
    raise_alerts(
        [
            NewAlert(
                type=AlertType.NODE_OFFLINE,
                severity=Severity.ERROR,
                scope=AlertScope.NODE,
                key=f"k{i}",
                node_id=f"n{i}",
                message="quiet",
            )
            for i in range(300)
        ]
    )
    barrier = threading.Barrier(2)
    results, errors = [], []

    def dispatcher():
        try:
            barrier.wait(10)
            # small batches, many of them: the two claim side by side
            results.append(dispatch_notifications(batch_size=10, max_batches=100))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=dispatcher) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(results) == 2
    assert sum(result.raised for result in results) == 300
    all_ids = results[0].deliveries + results[1].deliveries
    assert len(all_ids) == len(set(all_ids)) == 600
    pairs = list(NotificationDelivery.objects.values_list("alert_id", "channel_id"))
    assert len(pairs) == len(set(pairs)) == 600


@override_settings(HETEROFLOW_NOTIFY_BACKOFF_SECONDS=0.2)
def test_a_worker_delivers_what_the_dispatcher_queued_and_retries_through_the_broker(receiver, operator, worker):
    created = services.create_channel(principal=operator, tenant=None, name="live", kind="webhook", url=receiver.url)
    receiver.answer(500)  # the first attempt fails, the retry goes back through Redis
    raise_alert(
        type=AlertType.NODE_OFFLINE,
        severity=Severity.ERROR,
        scope=AlertScope.NODE,
        key="live",
        node_id="n1",
        message="quiet",
    )
    assert dispatch_notifications_job() == "ran"

    delivery = wait_until(
        lambda: NotificationDelivery.objects.filter(channel=created.channel, status="delivered").first(),
        30,
        "the worker to deliver after one retry",
    )
    assert delivery.attempts == 2 and delivery.event == "alert.raised"
    assert len(receiver.received) == 2 and all(r.verifies_with(created.secret) for r in receiver.received)


def test_a_test_asked_for_through_the_api_reaches_the_receiver_signed(receiver, worker, api):
    key = issue_platform_key(user=OperatorFactory(username="api-op"), name="live").key
    response = api.post(
        "/api/v1/alerts/channels", {"name": "api", "kind": "webhook", "url": receiver.url}, format="json", **bearer(key)
    )
    assert response.status_code == 201
    secret, channel_id = response.json()["secret"], response.json()["id"]
    queued = api.post(f"/api/v1/alerts/channels/{channel_id}/test", format="json", **bearer(key))
    assert queued.status_code == 202

    wait_until(lambda: receiver.received, 30, "the test notification")
    (request,) = receiver.received
    assert request.json["event"] == "test" and request.json["delivery"] == queued.json()["delivery"]
    assert request.verifies_with(secret)
    wait_until(
        lambda: NotificationDelivery.objects.get(pk=queued.json()["delivery"]).status == "delivered",
        10,
        "the delivery to be recorded",
    )
