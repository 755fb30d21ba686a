"""Beat's schedule, built from the periodic jobs each app declares once in its jobs.py
with `@periodic_job(name, every=...)` (apps.core.guard).

Each job's name is also its guard key, and `every` is both beat's period and the
guard's minimum gap, so the two can never disagree.

A per-host job is about the machine it runs on (its host metrics), so beat, which sends
each tick to whichever worker takes it first, cannot drive it: every worker sends it to
its own host's queue on its own timer instead (apps.monitoring.processes), and the guard
key carries the host, so each host runs it once per period however many workers it has.
"""

from __future__ import annotations


def beat_schedule() -> dict[str, dict]:
    from apps.core.guard import declared_jobs  # needs Django's apps loaded (beat's start)

    return {
        name: {"task": name, "schedule": job.every, "args": (), "options": {"expires": job.every}}
        for name, job in declared_jobs().items()
        if not job.per_host
    }


def host_queue(host: str) -> str:
    """The queue only the workers of `host` consume."""
    return f"heteroflow.host.{host}"
