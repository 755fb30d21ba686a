"""The alert sweep: every HETEROFLOW_ALERT_SWEEP_SECONDS (30 s). Every instance may run it (each task move is a CAS);
the guard only keeps one process from running it twice in the same period."""

from __future__ import annotations

from celery import shared_task

from apps.core.guard import run_periodic


@shared_task(name="alerts.sweep")
def sweep_job() -> str:
    from apps.alerts.failures import sweep

    return run_periodic("alerts.sweep", sweep).outcome
