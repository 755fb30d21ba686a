"""The alerts' jobs: the sweep (every HETEROFLOW_ALERT_SWEEP_SECONDS, 30 s; every instance
may run it, each task move being a CAS, and the guard only keeps one process from running
it twice in the same period), and the notification outbox (dispatch every 10 s, one
delivery attempt per job, queued by name: `enqueue("alerts.deliver_notification", id)`)."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from apps.alerts.failures import sweep
from apps.alerts.notifications.delivery import deliver
from apps.alerts.notifications.dispatch import dispatch_notifications
from apps.alerts.services import prune
from apps.core.enqueue import enqueue
from apps.core.guard import periodic_job

sweep_job = periodic_job("alerts.sweep", every=settings.HETEROFLOW_ALERT_SWEEP_SECONDS)(sweep)
# Hourly: ended alerts and finished deliveries past their retention (bounded batches).
prune_job = periodic_job("alerts.prune", every=3600)(prune)

# --- notifications (apps.alerts.notifications) ---------------------------------------------

# Every 10 s: alerts not yet dispatched become deliveries (the outbox).
dispatch_notifications_job = periodic_job("alerts.dispatch_notifications", every=10)(dispatch_notifications)


@shared_task(name="alerts.deliver_notification")
def deliver_notification_job(delivery_id: int) -> str:
    """One attempt of one delivery; a retry is queued with its back-off delay."""
    attempt = deliver(delivery_id)
    if attempt.retry_in is not None:
        enqueue("alerts.deliver_notification", delivery_id, countdown=attempt.retry_in)
    return attempt.outcome
