"""The scheduler's tick: every 5 s from beat, and at once when a task is queued or a
backlog remains. One cycle at a time across every worker and instance (the guard)."""

from __future__ import annotations

import logging

from celery import shared_task

from apps.core.guard import Outcome, run_periodic
from apps.monitoring import metrics

logger = logging.getLogger(__name__)


@shared_task(name="scheduler.tick")
def tick_job(immediate: bool = False) -> str:
    from apps.scheduler.services import run_cycle

    result = run_periodic("scheduler.tick", run_cycle, respect_period=not immediate)
    if result.outcome == Outcome.RAN and result.value.considered:  # cycles that found the queue empty are not timed
        cycle = result.value
        metrics.record_cycle(sum(cycle.phases.values()), len(cycle.bound), len(cycle.lost_races))
    if result.outcome == Outcome.RAN and result.value.backlog:
        schedule_now()
    return result.outcome


def schedule_now() -> None:
    """Ask for a cycle now (after the current transaction commits)."""
    try:
        tick_job.apply_async(kwargs={"immediate": True})
    except Exception:  # the broker is down: the 5 s tick still comes
        logger.warning("could not queue an immediate scheduler cycle")


@shared_task(name="scheduler.preemption_watchdog")
def preemption_watchdog_job() -> str:
    from apps.scheduler.services import force_overdue_preemptions

    return run_periodic("scheduler.preemption_watchdog", force_overdue_preemptions).outcome
