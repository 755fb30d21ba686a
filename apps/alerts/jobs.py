"""The alerts' jobs: the sweep (every HETEROFLOW_ALERT_SWEEP_SECONDS, 30 s; every instance
may run it, each task move being a CAS, and the guard only keeps one process from running
it twice in the same period), and the notification outbox (dispatch every 10 s, one
delivery attempt per job)."""

from __future__ import annotations

import logging

from celery import shared_task

from apps.core.guard import run_periodic


@shared_task(name="alerts.sweep")
def sweep_job() -> str:
    from apps.alerts.failures import sweep

    return run_periodic("alerts.sweep", sweep).outcome


# --- notifications (apps.alerts.notifications) ---------------------------------------------

logger = logging.getLogger(__name__)


@shared_task(name="alerts.dispatch_notifications")
def dispatch_notifications_job() -> str:
    """Every 10 s: alerts not yet dispatched become deliveries (the outbox)."""
    from apps.alerts.notifications.dispatch import dispatch_notifications

    return run_periodic("alerts.dispatch_notifications", dispatch_notifications).outcome


@shared_task(name="alerts.deliver_notification")
def deliver_notification_job(delivery_id: int) -> str:
    """One attempt of one delivery; a retry is queued with its back-off delay."""
    from apps.alerts.notifications.delivery import deliver

    attempt = deliver(delivery_id)
    if attempt.retry_in is not None:
        enqueue_delivery(delivery_id, countdown=attempt.retry_in)
    return attempt.outcome


def enqueue_delivery(delivery_id: int, countdown: float | None = None) -> None:
    try:
        deliver_notification_job.apply_async(args=[delivery_id], countdown=countdown)
    except Exception:  # the broker is down: the dispatcher queues overdue deliveries again
        logger.warning("could not queue notification delivery %s", delivery_id)
