"""Node metrics: a time series partitioned by day. Retention drops whole partitions
(no DELETE scan); reads are bucketed in SQL so any window returns a bounded number of
points."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from django.conf import settings
from django.db import DatabaseError, connection, transaction

from apps.core.clock import utcnow

PARTITION_PREFIX = "node_metrics_p"
DAYS_AHEAD = 3
MAX_POINTS = 400


def partition_name(day: date) -> str:
    return f"{PARTITION_PREFIX}{day:%Y%m%d}"


def ensure_partitions(cursor, today: date, days_ahead: int = DAYS_AHEAD) -> list[str]:
    created = []
    for offset in range(-1, days_ahead + 1):
        day = today + timedelta(days=offset)
        name = partition_name(day)
        cursor.execute("SELECT to_regclass(%s)", [name])
        if cursor.fetchone()[0] is None:
            start = datetime(day.year, day.month, day.day, tzinfo=UTC)
            try:
                with transaction.atomic():
                    cursor.execute(
                        f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF node_metrics FOR VALUES FROM (%s) TO (%s)",
                        [start, start + timedelta(days=1)],
                    )
            except DatabaseError:
                # Rows for that day already sit in the default partition (it was missing
                # when they arrived); they stay there until retention deletes them.
                continue
            created.append(name)
    return created


def drop_expired_partitions(cursor, cutoff: datetime) -> list[str]:
    cursor.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = 'node_metrics' AND c.relname LIKE %s",
        [PARTITION_PREFIX + "%"],
    )
    dropped = []
    for (name,) in cursor.fetchall():
        day = datetime.strptime(name.removeprefix(PARTITION_PREFIX), "%Y%m%d").replace(tzinfo=UTC)
        if day + timedelta(days=1) <= cutoff:
            cursor.execute(f"DROP TABLE IF EXISTS {name}")
            dropped.append(name)
    # Rows that landed in the default partition (a clock far off) are few: delete them.
    cursor.execute("DELETE FROM node_metrics_default WHERE at < %s", [cutoff])
    return dropped


def prune_and_prepare_partitions(now: datetime | None = None) -> dict:
    now = now or utcnow()
    cutoff = now - timedelta(hours=settings.METRICS_RETENTION_HOURS)
    with connection.cursor() as cursor:
        created = ensure_partitions(cursor, now.date())
        dropped = drop_expired_partitions(cursor, cutoff)
    return {"created": created, "dropped": dropped}


BUCKET_LADDER = (5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 86400)


def bucket_seconds(hours: int) -> int:
    """The smallest round bucket that keeps `hours` of history within MAX_POINTS points."""
    # A window that does not start on a bucket boundary touches one bucket more.
    return next(step for step in BUCKET_LADDER if hours * 3600 / step <= MAX_POINTS - 1)


def history(node_id: str, hours: int, now: datetime | None = None) -> dict:
    now = now or utcnow()
    step = bucket_seconds(hours)
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH samples AS (
                SELECT to_timestamp(floor(extract(epoch FROM at) / %(step)s) * %(step)s) AS bucket, cpu_used, memory_used, gpus
                FROM node_metrics WHERE node_id = %(node)s AND at >= %(since)s AND at <= %(now)s
            ), gpu AS (
                SELECT s.bucket, (g->>'i')::int AS idx, avg((g->>'u')::float8) AS u, avg((g->>'m')::float8) AS m,
                       avg((g->>'t')::float8) AS t, avg((g->>'p')::float8) AS p
                FROM samples s, jsonb_array_elements(s.gpus) AS g GROUP BY s.bucket, idx
            ), host AS (
                SELECT bucket, avg(cpu_used) AS cpu, avg(memory_used) AS mem, count(*) AS n FROM samples GROUP BY bucket
            )
            SELECT h.bucket, h.cpu, h.mem, h.n,
                   COALESCE(jsonb_agg(jsonb_build_object('index', gpu.idx, 'utilization', gpu.u, 'memory_used_mb', gpu.m,
                                                         'temperature', gpu.t, 'power_w', gpu.p) ORDER BY gpu.idx)
                            FILTER (WHERE gpu.idx IS NOT NULL), '[]'::jsonb)
            FROM host h LEFT JOIN gpu ON gpu.bucket = h.bucket
            GROUP BY h.bucket, h.cpu, h.mem, h.n ORDER BY h.bucket
            """,
            {"step": step, "node": node_id, "since": now - timedelta(hours=hours), "now": now},
        )
        rows = cursor.fetchall()
    import json

    points = [
        {
            "at": bucket.isoformat(),
            "cpu_used": cpu,
            "memory_used": mem,
            "samples": n,
            "gpus": json.loads(gpus) if isinstance(gpus, str) else gpus,
        }
        for bucket, cpu, mem, n, gpus in rows
    ]
    return {"node_id": node_id, "hours": hours, "bucket_seconds": step, "points": points}


def energy(node_id: str, hours: int, heartbeat_interval: int = 5, now: datetime | None = None) -> dict:
    """Energy from measured GPU power, integrated over the time between samples (each
    sample counts until the next one, at most three of the node's beats: a longer gap is
    silence, not power). None when no power was measured."""
    now = now or utcnow()
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH samples AS (
                SELECT at, (SELECT sum((g->>'p')::float8) FROM jsonb_array_elements(gpus) g WHERE g ? 'p') AS watts
                FROM node_metrics WHERE node_id = %(node)s AND at >= %(since)s AND at <= %(now)s
            ), spans AS (
                SELECT watts, LEAST(COALESCE(extract(epoch FROM lead(at) OVER (ORDER BY at) - at), 0), %(max_span)s) AS seconds FROM samples
            )
            SELECT sum(watts * seconds) / 3600000.0, avg(watts), max(watts), count(watts) FROM spans WHERE watts IS NOT NULL
            """,
            {"node": node_id, "since": now - timedelta(hours=hours), "now": now, "max_span": 3 * heartbeat_interval},
        )
        kwh, avg_w, max_w, samples = cursor.fetchone()
    return {
        "node_id": node_id,
        "hours": hours,
        "gpu_energy_kwh": kwh if samples else None,
        "gpu_power_avg_w": avg_w if samples else None,
        "gpu_power_max_w": max_w if samples else None,
        "samples_with_power": samples,
    }
