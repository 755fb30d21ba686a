"""The six-point health check for operators: database, storage, scheduler, GPU nodes,
broker and configuration. Every check looks at the real thing (a query, the disks, the
job rows, a PING to the broker, the migration state); none is a constant. Each answers
ok, warning or error with a message and, when not ok, what to do."""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, connection, transaction

from apps.core.clock import utcnow
from apps.monitoring import probes, selectors

OK, WARNING, ERROR = "ok", "warning", "error"
DISK_WARNING_PERCENT = 90.0
DISK_ERROR_PERCENT = 97.0
PENDING_WARNING = 10
OLDEST_PENDING_WARNING_SECONDS = 300.0
BROKER_TIMEOUT_SECONDS = 1.0
QUERY_TIMEOUT_MS = 2000


@dataclass
class Check:
    name: str
    status: str
    message: str
    suggestion: str = ""
    details: dict = field(default_factory=dict)


def check_database() -> Check:
    started = time.monotonic()
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT set_config('statement_timeout', %s, true)", [str(QUERY_TIMEOUT_MS)])
            cursor.execute("SELECT count(*) FROM nodes")
            nodes = cursor.fetchone()[0]
    except DatabaseError as exc:
        return Check(
            "database",
            ERROR,
            f"The database did not answer a query ({type(exc).__name__}).",
            "Check that PostgreSQL is up and reachable with DATABASE_URL.",
        )
    elapsed_ms = round((time.monotonic() - started) * 1000, 1)
    return Check(
        "database", OK, f"Answered a query in {elapsed_ms} ms.", details={"query_ms": elapsed_ms, "nodes": nodes}
    )


def disk_status(percent: float) -> str:
    if percent > DISK_ERROR_PERCENT:
        return ERROR
    return WARNING if percent > DISK_WARNING_PERCENT else OK


def check_storage(paths: dict[str, str] | None = None, usage=shutil.disk_usage) -> Check:
    """The root file system and the data folder's (they differ under containers), worst
    first, and the database's size."""
    paths = paths or {"root": "/", "data": str(settings.HETEROFLOW_DATA_DIR)}
    disks, worst = {}, OK
    for label, path in paths.items():
        try:
            total, used, free = usage(path)
        except OSError:
            continue
        percent = round(used / total * 100, 1) if total else 0.0
        disks[label] = {"path": path, "percent": percent, "free_bytes": free, "total_bytes": total}
        status = disk_status(percent)
        if status == ERROR or (status == WARNING and worst == OK):
            worst = status
    details = {"disks": disks}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_database_size(current_database())")
            details["database_bytes"] = cursor.fetchone()[0]
    except DatabaseError:
        pass  # the database check reports that
    if not disks:
        return Check("storage", ERROR, "No disk could be read.", "Check the paths and permissions.", details)
    fullest = max(disks.items(), key=lambda item: item[1]["percent"])
    message = f"Fullest disk: {fullest[0]} ({fullest[1]['path']}) at {fullest[1]['percent']}%."
    suggestion = (
        "" if worst == OK else "Free disk space or grow the volume; PostgreSQL and the logs stop when it is full."
    )
    return Check("storage", worst, message, suggestion, details)


def evaluate_scheduler(running: bool, pending: int, oldest_pending_age: float | None) -> tuple[str, str, str]:
    """(status, message, suggestion): exactly one of three paths."""
    if not running:
        return (
            ERROR,
            "No scheduler cycle finished in the last 15 s.",
            "Start Celery beat and a worker (the scheduler.tick job runs every 5 s).",
        )
    if pending > PENDING_WARNING or (oldest_pending_age or 0) > OLDEST_PENDING_WARNING_SECONDS:
        age = f", oldest waiting {int(oldest_pending_age)} s" if oldest_pending_age is not None else ""
        return (
            WARNING,
            f"Running; {pending} tasks pending{age}.",
            "See why tasks wait in their schedule_reason; add capacity or check quotas.",
        )
    return OK, f"Running; {pending} tasks pending.", ""


def check_scheduler(now: datetime) -> Check:
    queue = selectors.task_queue(now)
    running = probes.scheduler_state(now) == "running"
    status, message, suggestion = evaluate_scheduler(running, queue["pending"], queue["oldest_pending_age_seconds"])
    return Check(
        "scheduler",
        status,
        message,
        suggestion,
        {
            "running": running,
            "pending": queue["pending"],
            "oldest_pending_age_seconds": queue["oldest_pending_age_seconds"],
        },
    )


def check_gpu_nodes() -> Check:
    online = selectors.gpu_nodes_online()
    if online == 0:
        return Check(
            "gpu_nodes",
            WARNING,
            "No online node has a GPU.",
            "Start the agent on the GPU servers and check their heartbeats.",
            {"online_gpu_nodes": 0},
        )
    return Check("gpu_nodes", OK, f"{online} online nodes with GPUs.", details={"online_gpu_nodes": online})


def check_broker(url: str | None = None, timeout: float = BROKER_TIMEOUT_SECONDS) -> Check:
    import redis

    url = url or settings.REDIS_URL
    started = time.monotonic()
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        client.ping()
    except Exception as exc:  # any failure means the broker cannot take jobs
        return Check(
            "broker",
            ERROR,
            f"The broker did not answer PING ({type(exc).__name__}).",
            "Check that Redis is up and reachable with REDIS_URL; without it no job runs.",
        )
    finally:
        client.close()
    elapsed_ms = round((time.monotonic() - started) * 1000, 1)
    return Check("broker", OK, f"Answered PING in {elapsed_ms} ms.", details={"ping_ms": elapsed_ms})


def unapplied_migrations() -> list[str]:
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return [f"{migration.app_label}.{migration.name}" for migration, _backwards in plan]


def check_configuration(pending_migrations=unapplied_migrations) -> Check:
    from heteroflow.safety import production_problems

    problems = []
    if settings.PRODUCTION:
        problems = production_problems(
            secret_key=settings.SECRET_KEY,
            debug=settings.DEBUG,
            allowed_hosts=settings.ALLOWED_HOSTS,
            agent_secret=settings.HETEROFLOW_AGENT_SECRET,
        )
    try:
        pending = pending_migrations()
    except DatabaseError:
        return Check("configuration", ERROR, "The migration state could not be read.", "See the database check.")
    details = {"mode": settings.HETEROFLOW_ENV, "unapplied_migrations": pending}
    if pending:
        return Check(
            "configuration",
            ERROR,
            f"{len(pending)} migrations are not applied.",
            "Run `manage.py migrate_schemas`.",
            details,
        )
    if problems:
        return Check(
            "configuration",
            ERROR,
            "Unsafe production settings: " + "; ".join(problems) + ".",
            "See docs/configuration.md#production-refusals.",
            details,
        )
    return Check(
        "configuration", OK, f"Settings loaded ({settings.HETEROFLOW_ENV} mode); migrations applied.", details=details
    )


def overall(checks: list[Check]) -> str:
    """healthy: all ok; unhealthy: the database fails, or three or more are not ok;
    degraded otherwise."""
    not_ok = [check for check in checks if check.status != OK]
    if any(check.name == "database" and check.status == ERROR for check in checks) or len(not_ok) >= 3:
        return "unhealthy"
    return "degraded" if not_ok else "healthy"


def run_all(now: datetime | None = None) -> dict:
    now = now or utcnow()
    database = check_database()
    checks = [database, check_storage()]
    if database.status == ERROR:
        # the other checks read the database; they would only repeat its failure slowly
        checks += [
            Check(name, ERROR, "Not checked: the database does not answer.") for name in ("scheduler", "gpu_nodes")
        ]
        checks.append(check_broker())
        checks.append(Check("configuration", ERROR, "Not checked: the database does not answer."))
    else:
        checks += [check_scheduler(now), check_gpu_nodes(), check_broker(), check_configuration()]
    return {"status": overall(checks), "checked_at": now, "checks": [asdict(check) for check in checks]}
