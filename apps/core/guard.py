"""The per-job guard for periodic work.

Two beats, two control-plane instances or a redelivered message may all deliver the same
tick. `run_guarded` lets exactly one of them run it: inside one transaction it takes a
transaction-level advisory lock for the job's key (a concurrent runner gets BUSY at once,
it never queues behind the first) and then reads the job's last-run row; a tick that
arrives before most of the period has passed is EARLY and does nothing.

A periodic job is declared once, with `@periodic_job(name, every=...)` on its body in
its app's jobs.py: that registers the Celery task under the name, runs the body under
the guard keyed by the name with `every` as its period, and records the declaration
that beat's schedule (heteroflow/beat.py) and the per-host timers
(apps.monitoring.processes) are built from.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery import shared_task
from django.db import transaction

from apps.core import locks
from apps.core.clock import utcnow
from apps.core.enqueue import import_job_modules
from apps.core.models import JobRun
from apps.monitoring import metrics

logger = logging.getLogger(__name__)

# A tick may arrive a little before a full period has passed (beat's own jitter); only a
# tick that comes well inside the period is a duplicate.
EARLY_FRACTION = 0.8


class Outcome(enum.StrEnum):
    RAN = "ran"
    BUSY = "busy"
    EARLY = "early"
    FAILED = "failed"


@dataclass(frozen=True)
class GuardResult:
    outcome: Outcome
    value: Any = None


def run_guarded(
    key: str, every: timedelta, work: Callable[[], Any], *, now: datetime | None = None, respect_period: bool = True
) -> GuardResult:
    """`respect_period=False` is for on-demand runs (a new task should be scheduled now):
    still never two at once, but not held back by the period."""
    started = time.monotonic()
    result = _run_guarded(key, every, work, now=now, respect_period=respect_period)
    ran = result.outcome in (Outcome.RAN, Outcome.FAILED)
    metrics.record_job(key, result.outcome, time.monotonic() - started if ran else None)
    return result


def _run_guarded(key, every, work, *, now, respect_period) -> GuardResult:
    now = now or utcnow()
    with transaction.atomic():
        # named for the transaction: whose locks a beat waits on shows in pg_stat_activity
        if not locks.try_xact_lock_named(f"job:{key}", f"job:{key}"):
            return GuardResult(Outcome.BUSY)
        run, _ = JobRun.objects.get_or_create(key=key)
        if respect_period and run.last_started_at and now - run.last_started_at < every * EARLY_FRACTION:
            return GuardResult(Outcome.EARLY)
        run.last_started_at = now
        run.runs += 1
        started = time.monotonic()
        try:
            with transaction.atomic():
                value = work()
        except Exception as exc:
            logger.exception("periodic job %s failed", key)
            run.last_outcome, run.last_error = Outcome.FAILED, f"{type(exc).__name__}: {exc}"
            _finish(run, time.monotonic() - started)
            return GuardResult(Outcome.FAILED)
        run.last_outcome, run.last_error = Outcome.RAN, ""
        _finish(run, time.monotonic() - started)
        return GuardResult(Outcome.RAN, value)


def _finish(run: JobRun, seconds: float) -> None:
    """The run's end and how long its work took (the row is ours: the job's lock is held)."""
    run.last_finished_at = utcnow()
    run.total_seconds += seconds
    run.max_seconds = max(run.max_seconds, seconds)
    run.save()


@dataclass(frozen=True)
class PeriodicJob:
    name: str  # the Celery task's name, beat's entry and the guard's key
    every: float  # seconds: beat's period and the guard's minimum gap, so they never disagree
    # A per-host job is about the machine it runs on (its host metrics): beat, which sends
    # each tick to whichever worker takes it first, cannot drive it. Every worker sends it
    # to its own host's queue on its own timer instead, and the guard key carries the
    # host (`host_name()`), so each host runs it once per period.
    host_name: Callable[[], str] | None = None

    @property
    def per_host(self) -> bool:
        return self.host_name is not None


_DECLARED: dict[str, PeriodicJob] = {}


def periodic_job(name: str, *, every: float, host_name: Callable[[], str] | None = None):
    """Declare a periodic job: `@periodic_job("alerts.sweep", every=30)` on a function of
    no arguments. Returns the Celery task `name`; run as `task()` or by beat it runs the
    function under the guard and answers the outcome; `task(immediate=True)` is an
    on-demand run, not held back by the period (still never two at once)."""
    if name in _DECLARED:
        raise ValueError(f"periodic job {name!r} is declared twice")
    declared = _DECLARED[name] = PeriodicJob(name, float(every), host_name)

    def declare(work: Callable[[], Any]):
        def job(immediate: bool = False) -> str:
            host = declared.host_name() if declared.host_name else None
            return run_periodic(name, work, respect_period=not immediate, host=host).outcome

        if work.__name__.isidentifier():  # Celery compiles a stub by this name (not for a lambda)
            job.__name__, job.__qualname__ = work.__name__, work.__qualname__
        job.__module__, job.__doc__ = work.__module__, work.__doc__
        return shared_task(name=name)(job)

    return declare


def declared_jobs() -> dict[str, PeriodicJob]:
    """Every periodic job, by name (imports the apps' jobs modules first)."""
    import_job_modules()
    return dict(_DECLARED)


def run_periodic(
    key: str,
    work: Callable[[], Any],
    *,
    now: datetime | None = None,
    respect_period: bool = True,
    host: str | None = None,
) -> GuardResult:
    """Run `work` under the guard and period of the periodic job `key`; a per-host job
    under one guard per host."""
    every = timedelta(seconds=declared_jobs()[key].every)
    return run_guarded(per_host_key(key, host) if host else key, every, work, now=now, respect_period=respect_period)


JOB_KEY_MAX_LENGTH = 100  # JobRun.key


def per_host_key(key: str, host: str) -> str:
    whole = f"{key}@{host}"
    if len(whole) <= JOB_KEY_MAX_LENGTH:
        return whole
    digest = hashlib.blake2b(host.encode(), digest_size=6).hexdigest()
    return f"{key}@{host[: JOB_KEY_MAX_LENGTH - len(key) - len(digest) - 2]}~{digest}"
