"""Liveness probes. Each answers within its time limit and never raises."""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta

import psycopg

from apps.core.clock import utcnow
from apps.core.db import libpq_params
from apps.core.models import JobRun

logger = logging.getLogger(__name__)

DATABASE_TIMEOUT_SECONDS = 2.0
# The scheduler's periodic job (the tasks issue adds it to beat). Its last-run row is
# shared by every instance, so this says whether the scheduler runs anywhere in the
# cluster: it counts as running when a tick finished within three of its 5 s periods.
SCHEDULER_JOB_KEY = "scheduler.tick"
SCHEDULER_FRESH = timedelta(seconds=15)


def database_params(**overrides) -> dict:
    return libpq_params(**overrides)


def database_answers(timeout: float = DATABASE_TIMEOUT_SECONDS) -> bool:
    """Open a fresh connection and run a query, giving up after about `timeout` seconds.

    A fresh connection (not Django's pooled one) so that a wedged pooled connection
    cannot make the probe lie, and so the time limit covers connecting as well."""
    # libpq's connect_timeout has a floor of 2 s and whole-second resolution.
    params = database_params(connect_timeout=max(2, math.ceil(timeout)))
    started = time.monotonic()
    try:
        with psycopg.connect(**params) as conn:
            remaining_ms = max(100, int((timeout - (time.monotonic() - started)) * 1000))
            conn.execute(f"SET statement_timeout = {remaining_ms}")
            conn.execute("SELECT 1").fetchone()
        return True
    except Exception as exc:  # any failure means "does not answer"
        logger.warning("database probe failed: %s", type(exc).__name__)
        return False


def scheduler_state(now=None) -> str:
    now = now or utcnow()
    run = JobRun.objects.filter(key=SCHEDULER_JOB_KEY).only("last_finished_at").first()
    if run is None or run.last_finished_at is None:
        return "not_running"
    return "running" if now - run.last_finished_at <= SCHEDULER_FRESH else "not_running"
