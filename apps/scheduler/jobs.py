"""The scheduler's tick: every 5 s from beat, and at once when a task is queued or a
backlog remains (`enqueue("scheduler.tick", immediate=True)`). One cycle at a time
across every worker and instance (the guard)."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from apps.core.clock import utcnow
from apps.core.enqueue import enqueue
from apps.core.guard import periodic_job
from apps.monitoring import metrics
from apps.scheduler import predictions, quotas, simulations
from apps.scheduler.cycle import CycleResult, run_cycle
from apps.scheduler.preemption import force_overdue_preemptions
from apps.scheduler.snapshot import GpuRowCache

# The GPU rows this worker process read, reused by its next ticks (for
# HETEROFLOW_SCHEDULER_GPU_REUSE_SECONDS): the tick's, handed to every cycle it runs.
gpu_rows = GpuRowCache()


@periodic_job("scheduler.tick", every=5)
def tick_job() -> CycleResult:
    cycle = run_cycle(gpu_rows=gpu_rows)
    if cycle.considered:  # cycles that found the queue empty are not timed
        metrics.record_cycle(sum(cycle.phases.values()), len(cycle.bound), len(cycle.lost_races))
    if cycle.backlog:  # sent once the guard's transaction commits
        enqueue("scheduler.tick", immediate=True)
    return cycle


preemption_watchdog_job = periodic_job("scheduler.preemption_watchdog", every=30)(force_overdue_preemptions)


@periodic_job("scheduler.queue_usage", every=60)
def queue_usage_job() -> int:
    """Each queue's cards above nominal into its decayed usage (the fair-share order)."""
    return quotas.account_usage(utcnow())


@periodic_job("scheduler.predict", every=settings.HETEROFLOW_PREDICT_INTERVAL_SECONDS)
def predict_job() -> predictions.PredictResult:
    """Every waiting task's and group's start-time estimate (docs/predictions.md)."""
    return predictions.predict()


@shared_task(name="scheduler.simulate")
def simulate_job(simulation_id: int) -> str:
    """One replay an operator asked for (docs/simulate.md#from-the-api-hf-and-the-portal)."""
    return simulations.run(simulation_id)


@periodic_job("scheduler.simulations_sweep", every=60)
def simulations_sweep_job() -> int:
    """Replays left queued by a lost message sent again; those left running by a dead worker failed."""
    return simulations.sweep()
