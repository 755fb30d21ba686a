"""The alert sweep: every 30 s. Every instance may run it (each task move is a CAS);
the guard only keeps one process from running it twice in the same period."""

from __future__ import annotations

from celery import shared_task

from apps.core.guard import run_periodic


@shared_task(name="alerts.sweep")
def sweep_job() -> str:
    from apps.alerts.services import sweep_offline_nodes

    return run_periodic("alerts.sweep", sweep_offline_nodes).outcome
