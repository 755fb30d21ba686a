"""Beat's schedule: the one place where periodic work and its period are declared.

Each entry's key is also the job's guard key (apps.core.guard), and `every` is both
beat's period and the guard's minimum gap, so the two can never disagree.

A per-host job is about the machine it runs on (its host metrics), so beat, which sends
each tick to whichever worker takes it first, cannot drive it: every worker sends it to
its own host's queue on its own timer instead (apps.monitoring.processes), and the guard
key carries the host, so each host runs it once per period however many workers it has.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PeriodicJob:
    task: str
    every: float  # seconds
    per_host: bool = False


def _seconds(setting: str) -> float:
    from django.conf import settings

    return float(getattr(settings, setting))


PERIODIC_JOBS: dict[str, PeriodicJob] = {
    "core.purge_expired_sessions": PeriodicJob("core.purge_expired_sessions", every=3600.0),
    "nodes.check_health": PeriodicJob("nodes.check_health", every=5.0),
    "scheduler.tick": PeriodicJob("scheduler.tick", every=5.0),
    "scheduler.preemption_watchdog": PeriodicJob("scheduler.preemption_watchdog", every=30.0),
    "alerts.sweep": PeriodicJob("alerts.sweep", every=_seconds("HETEROFLOW_ALERT_SWEEP_SECONDS")),
    "alerts.dispatch_notifications": PeriodicJob("alerts.dispatch_notifications", every=10.0),
    # also requested every 500 heartbeats; the guard keeps it to once per period
    "nodes.prune_metrics": PeriodicJob("nodes.prune_metrics", every=600.0),
    "monitoring.collect_server_metrics": PeriodicJob("monitoring.collect_server_metrics", every=30.0, per_host=True),
    "monitoring.prune_server_metrics": PeriodicJob("monitoring.prune_server_metrics", every=3600.0),
}


def beat_schedule() -> dict[str, dict]:
    return {
        key: {"task": job.task, "schedule": job.every, "args": (), "options": {"expires": job.every}}
        for key, job in PERIODIC_JOBS.items()
        if not job.per_host
    }


def host_queue(host: str) -> str:
    """The queue only the workers of `host` consume."""
    return f"heteroflow.host.{host}"
