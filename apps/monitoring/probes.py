"""Liveness probes. Each answers within its time limit and never raises."""

from __future__ import annotations

import logging
import math
from datetime import timedelta

import psycopg
from django.db import connections

from apps.core.clock import utcnow

logger = logging.getLogger(__name__)

DATABASE_TIMEOUT_SECONDS = 2.0
# The scheduler's periodic job (the tasks issue adds it to beat). It counts as running
# when it finished a tick within three of its 5 s periods.
SCHEDULER_JOB_KEY = "scheduler.tick"
SCHEDULER_FRESH = timedelta(seconds=15)


def database_settings() -> dict:
    return connections["default"].settings_dict


def database_answers(timeout: float = DATABASE_TIMEOUT_SECONDS) -> bool:
    """Open a fresh connection and run a query, all within `timeout` seconds.

    A fresh connection (not Django's pooled one) so that a wedged pooled connection
    cannot make the probe lie, and so the time limit covers connecting as well."""
    db = database_settings()
    params = {
        "host": db.get("HOST") or None,
        "port": db.get("PORT") or None,
        "dbname": db.get("NAME"),
        "user": db.get("USER") or None,
        "password": db.get("PASSWORD") or None,
        # libpq's connect_timeout has a floor of 2 s and whole-second resolution.
        "connect_timeout": max(2, math.ceil(timeout)),
        "options": f"-c statement_timeout={int(timeout * 1000)}",
    }
    try:
        with psycopg.connect(**{k: v for k, v in params.items() if v is not None}) as conn:
            conn.execute("SELECT 1").fetchone()
        return True
    except Exception as exc:  # any failure means "does not answer"
        logger.warning("database probe failed: %s", type(exc).__name__)
        return False


def scheduler_state(now=None) -> str:
    from apps.core.models import JobRun

    now = now or utcnow()
    run = JobRun.objects.filter(key=SCHEDULER_JOB_KEY).only("last_finished_at").first()
    if run is None or run.last_finished_at is None:
        return "not_running"
    return "running" if now - run.last_finished_at <= SCHEDULER_FRESH else "not_running"
