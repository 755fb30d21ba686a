"""Node metrics: a time series partitioned by day. Retention drops whole partitions
(no DELETE scan); reads are bucketed in SQL so any window returns a bounded number of
points."""

from __future__ import annotations

import json
from datetime import date, datetime, timedelta

from django.conf import settings
from django.db import connection

from apps.core.clock import utcnow
from apps.core.partitions import DailyTable
from apps.nodes import carbon
from apps.nodes.models import EnergyDaily

NODE_METRICS = DailyTable("node_metrics", "at")
# the retention job's period (apps.nodes.jobs), also how often a web process asks for it
PRUNE_EVERY_SECONDS = 600
MAX_POINTS = 400


def prune_and_prepare_partitions(now: datetime | None = None) -> dict:
    now = now or utcnow()
    return NODE_METRICS.prune_and_prepare(now, now - timedelta(hours=settings.METRICS_RETENTION_HOURS))


BUCKET_LADDER = (5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 86400)


def bucket_seconds(hours: int) -> int:
    """The smallest round bucket that keeps `hours` of history within MAX_POINTS points."""
    return bucket_for(hours * 3600)


def bucket_for(seconds: float) -> int:
    """The smallest round bucket that keeps `seconds` of history within MAX_POINTS points."""
    # A window that does not start on a bucket boundary touches one bucket more.
    return next(step for step in BUCKET_LADDER if seconds / step <= MAX_POINTS - 1)


def card_series(node_id: str, indices: list[int], since: datetime, now: datetime) -> tuple[int, list[dict]]:
    """Some cards' readings over a window, from the heartbeats' samples (a task's cards:
    GET /api/v1/tasks/{id}/metrics), bucketed to at most MAX_POINTS points: (the bucket's
    seconds, [{"at", "gpus": [{"index", "node_id", "utilization", "memory_used_mb",
    "power_w", "temperature"}]}]). A reading a card did not report is null, never 0."""
    step = bucket_for((now - since).total_seconds())
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT to_timestamp(floor(extract(epoch FROM m.at) / %(step)s) * %(step)s) AS bucket,
                   jsonb_agg(jsonb_build_object('index', c.idx, 'node_id', %(node)s, 'utilization', c.u,
                                                'memory_used_mb', c.m, 'power_w', c.p, 'temperature', c.t)
                             ORDER BY c.idx)
            FROM node_metrics AS m
            CROSS JOIN LATERAL (
                SELECT (g->>'i')::int AS idx, (g->>'u')::float8 AS u, (g->>'m')::float8 AS m,
                       (g->>'p')::float8 AS p, (g->>'t')::float8 AS t
                FROM jsonb_array_elements(m.gpus) AS g WHERE (g->>'i')::int = ANY(%(cards)s)
            ) AS c
            WHERE m.node_id = %(node)s AND m.at >= %(since)s AND m.at <= %(now)s
            GROUP BY bucket ORDER BY bucket
            """,
            {"step": step, "node": node_id, "cards": indices, "since": since, "now": now},
        )
        rows = cursor.fetchall()
    samples = []
    for bucket, cards in rows:
        cards = json.loads(cards) if isinstance(cards, str) else cards
        merged: dict[int, dict] = {}
        for card in cards:  # several samples in a bucket: their mean
            merged.setdefault(card["index"], []).append(card)
        samples.append({"at": bucket.isoformat(), "gpus": [_mean_card(readings) for readings in merged.values()]})
    return step, samples


def _mean_card(readings: list[dict]) -> dict:
    out = dict(readings[0])
    for key in ("utilization", "memory_used_mb", "power_w", "temperature"):
        values = [reading[key] for reading in readings if reading[key] is not None]
        out[key] = sum(values) / len(values) if values else None
    return out


def history(node_id: str, hours: int, now: datetime | None = None) -> dict:
    now = now or utcnow()
    step = bucket_seconds(hours)
    with connection.cursor() as cursor:
        cursor.execute(
            (
                "\n"
                "            WITH samples AS (\n"
                "                SELECT to_timestamp(floor(extract(epoch FROM at) / %(step)s) * %(step)s) AS bucket, "
                "cpu_used, memory_used, gpus\n"
                "                FROM node_metrics WHERE node_id = %(node)s AND at >= %(since)s AND at <= %(now)s\n"
                "            ), gpu AS (\n"
                "                SELECT s.bucket, (g->>'i')::int AS idx, avg((g->>'u')::float8) AS u, "
                "avg((g->>'m')::float8) AS m,\n"
                "                       avg((g->>'t')::float8) AS t, avg((g->>'p')::float8) AS p\n"
                "                FROM samples s, jsonb_array_elements(s.gpus) AS g GROUP BY s.bucket, idx\n"
                "            ), host AS (\n"
                "                SELECT bucket, avg(cpu_used) AS cpu, avg(memory_used) AS mem, "
                "count(*) AS n FROM samples GROUP BY bucket\n"
                "            )\n"
                "            SELECT h.bucket, h.cpu, h.mem, h.n,\n"
                "                   COALESCE(jsonb_agg(jsonb_build_object('index', gpu.idx, 'utilization', gpu.u, "
                "'memory_used_mb', gpu.m,\n"
                "                                                         'temperature', gpu.t, 'power_w', "
                "gpu.p) ORDER BY gpu.idx)\n"
                "                            FILTER (WHERE gpu.idx IS NOT NULL), '[]'::jsonb)\n"
                "            FROM host h LEFT JOIN gpu ON gpu.bucket = h.bucket\n"
                "            GROUP BY h.bucket, h.cpu, h.mem, h.n ORDER BY h.bucket\n"
                "            "
            ),
            {"step": step, "node": node_id, "since": now - timedelta(hours=hours), "now": now},
        )
        rows = cursor.fetchall()
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


# --- energy (docs/energy.md) ---------------------------------------------------------------

# The CPU estimate's model: power = TDP × (idle + (1 − idle) × utilisation), with the idle
# fraction the heartbeat's accumulator uses (settings.HETEROFLOW_CPU_IDLE_POWER_FRACTION).
DEFAULT_CPU_IDLE_POWER_FRACTION = 0.3
MAX_DAYS = 366


def cpu_idle_fraction() -> float:
    return float(getattr(settings, "HETEROFLOW_CPU_IDLE_POWER_FRACTION", DEFAULT_CPU_IDLE_POWER_FRACTION))


def cpu_tdp(node) -> tuple[float | None, str | None]:
    """The TDP the CPU estimate uses and where it comes from: the operator's, else the
    CPU model table's; (None, None) when neither is known (no estimate)."""
    if node.cpu_tdp_w is not None:
        return node.cpu_tdp_w, "operator"
    if node.cpu_tdp_w_model is not None:
        return node.cpu_tdp_w_model, "model"
    return None, None


# The CPU estimate of a node_metrics row, in SQL (%(tdp)s null: no estimate).
_CPU_WATTS = "%(tdp)s::float8 * (%(idle)s + (1 - %(idle)s) * LEAST(GREATEST(cpu_used, 0), 100) / 100.0)"


def energy(
    node_id: str, hours: int, heartbeat_interval: int = 5, now: datetime | None = None, tdp_w: float | None = None
) -> dict:
    """The window's energy: GPU from measured power, integrated over the time between
    samples (each sample counts until the next one, at most three of the node's beats:
    a longer gap is silence, not power); the CPU estimate likewise from cpu_used × TDP.
    None when nothing was measured (or no TDP is known), never 0."""
    now = now or utcnow()
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            WITH samples AS (
                SELECT at, (SELECT sum((g->>'p')::float8) FROM jsonb_array_elements(gpus) g WHERE g ? 'p') AS watts,
                       {_CPU_WATTS} AS cpu_watts
                FROM node_metrics WHERE node_id = %(node)s AND at >= %(since)s AND at <= %(now)s
            ), spans AS (
                SELECT watts, cpu_watts,
                       LEAST(COALESCE(extract(epoch FROM lead(at) OVER (ORDER BY at) - at), 0), %(max_span)s) AS seconds
                FROM samples
            )
            SELECT sum(watts * seconds) / 3600000.0, avg(watts), max(watts), count(watts),
                   sum(cpu_watts * seconds) / 3600000.0, count(cpu_watts)
            FROM spans
            """,
            {
                "node": node_id,
                "since": now - timedelta(hours=hours),
                "now": now,
                "max_span": 3 * heartbeat_interval,
                "tdp": tdp_w,
                "idle": cpu_idle_fraction(),
            },
        )
        kwh, avg_w, max_w, samples, cpu_kwh, cpu_samples = cursor.fetchone()
    return {
        "node_id": node_id,
        "hours": hours,
        "gpu_energy_kwh": kwh if samples else None,
        "gpu_power_avg_w": avg_w if samples else None,
        "gpu_power_max_w": max_w if samples else None,
        "samples_with_power": samples,
        "cpu_energy_kwh_estimate": cpu_kwh if cpu_samples else None,
    }


def power_series(node_id: str, hours: int, tdp_w: float | None = None, now: datetime | None = None) -> dict:
    """Power over the window in the history's buckets: per card (measured), the node's
    GPU total (the cards that reported, summed per sample), and the CPU estimate. A
    bucket without a reading is null (a gap in the chart), never 0."""
    now = now or utcnow()
    step = bucket_seconds(hours)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            WITH samples AS (
                SELECT to_timestamp(floor(extract(epoch FROM at) / %(step)s) * %(step)s) AS bucket, gpus,
                       (SELECT sum((g->>'p')::float8) FROM jsonb_array_elements(gpus) g WHERE g ? 'p') AS watts,
                       {_CPU_WATTS} AS cpu_watts
                FROM node_metrics WHERE node_id = %(node)s AND at >= %(since)s AND at <= %(now)s
            ), card AS (
                SELECT s.bucket, (g->>'i')::int AS idx, avg((g->>'p')::float8) AS p
                FROM samples s, jsonb_array_elements(s.gpus) AS g WHERE g ? 'p' GROUP BY s.bucket, idx
            ), node AS (
                SELECT bucket, avg(watts) AS watts, avg(cpu_watts) AS cpu_watts FROM samples GROUP BY bucket
            )
            SELECT node.bucket, node.watts, node.cpu_watts,
                   COALESCE(jsonb_agg(jsonb_build_object('index', card.idx, 'power_w', card.p) ORDER BY card.idx)
                            FILTER (WHERE card.idx IS NOT NULL), '[]'::jsonb)
            FROM node LEFT JOIN card ON card.bucket = node.bucket
            GROUP BY node.bucket, node.watts, node.cpu_watts ORDER BY node.bucket
            """,
            {
                "step": step,
                "node": node_id,
                "since": now - timedelta(hours=hours),
                "now": now,
                "tdp": tdp_w,
                "idle": cpu_idle_fraction(),
            },
        )
        rows = cursor.fetchall()
    points = [
        {
            "at": bucket.isoformat(),
            "gpus": json.loads(cards) if isinstance(cards, str) else cards,
            "gpu_power_w": watts,
            "cpu_power_w_estimate": cpu_watts,
        }
        for bucket, watts, cpu_watts, cards in rows
    ]
    return {"bucket_seconds": step, "cpu_estimate": True, "points": points}


def card_measured(gpu) -> bool:
    """A card whose accumulator has started: it measured power at least once."""
    return gpu.energy_since is not None or gpu.power_at is not None or gpu.energy_wh > 0


def lifetime(node, gpus) -> dict:
    """The accumulators (long-lived, not bounded by the metrics retention): per card its
    measured kWh since `since` and the seconds of gaps not counted; the node's GPU total
    over the cards that measured; the CPU estimate apart. Null where nothing was measured."""
    cards = []
    for gpu in gpus:
        measured = card_measured(gpu)
        cards.append(
            {
                "index": gpu.index,
                "energy_kwh": gpu.energy_wh / 1000.0 if measured else None,
                "since": gpu.energy_since,
                "gap_seconds": gpu.energy_gap_seconds if measured else None,
                "power_w": gpu.power_w,
                "power_at": gpu.power_at,
                "lost": gpu.lost_at is not None,
            }
        )
    measured = [card for card in cards if card["energy_kwh"] is not None]
    tdp_w, tdp_source = cpu_tdp(node)
    cpu_measured = node.cpu_power_at is not None or node.cpu_energy_wh_estimate > 0
    return {
        "gpu_energy_kwh": sum(card["energy_kwh"] for card in measured) if measured else None,
        "since": min((card["since"] for card in measured if card["since"]), default=None),
        "gap_seconds": sum(card["gap_seconds"] for card in measured) if measured else None,
        "gpus": cards,
        "cpu_estimate": {
            "estimate": True,
            "energy_kwh": node.cpu_energy_wh_estimate / 1000.0 if cpu_measured else None,
            "power_w": node.cpu_power_w_estimate,
            "at": node.cpu_power_at,
            "tdp_w": tdp_w,
            "tdp_source": tdp_source,
        },
    }


def daily(node_id: str, days: int, today: date | None = None) -> list[dict]:
    """The last `days` UTC days from energy_daily, oldest first; a day without a row is
    null (no data), never 0. gpu_index -1 is the CPU estimate."""
    today = today or utcnow().date()
    first = today - timedelta(days=days - 1)
    by_day: dict[date, dict] = {}
    for day, index, wh in EnergyDaily.objects.filter(node_id=node_id, day__gte=first, day__lte=today).values_list(
        "day", "gpu_index", "wh"
    ):
        row = by_day.setdefault(day, {"gpu_kwh": None, "cpu_kwh_estimate": None, "gpus": []})
        if index == EnergyDaily.CPU_ESTIMATE:
            row["cpu_kwh_estimate"] = wh / 1000.0
        else:
            row["gpu_kwh"] = (row["gpu_kwh"] or 0.0) + wh / 1000.0
            row["gpus"].append({"index": index, "kwh": wh / 1000.0})
    out = []
    for offset in range(days):
        day = first + timedelta(days=offset)
        row = by_day.get(day, {"gpu_kwh": None, "cpu_kwh_estimate": None, "gpus": []})
        out.append({"day": day.isoformat(), **row, "gpus": sorted(row["gpus"], key=lambda card: card["index"])})
    return out


def node_energy(node, principal, *, hours: int, days: int = 30, now: datetime | None = None) -> dict:
    """GET /api/v1/nodes/{id}/energy and the monitor's energy section: the window's
    energy (the kept top-level fields), the accumulators, the power series, the daily
    energy, and carbon under apps.nodes.carbon's factor and role rules."""
    now = now or utcnow()
    tdp_w, _ = cpu_tdp(node)
    window = energy(node.pk, hours, node.heartbeat_interval, now, tdp_w=tdp_w)
    kept = lifetime(node, list(node.gpus.order_by("index")))
    factor = carbon.factor_for(node)
    figures = {
        "lifetime_gpu": kept["gpu_energy_kwh"],
        "window_gpu": window["gpu_energy_kwh"],
        "lifetime_cpu_estimate": kept["cpu_estimate"]["energy_kwh"],
        "window_cpu_estimate": window["cpu_energy_kwh_estimate"],
    }
    return {
        **window,
        "days": days,
        "lifetime": kept,
        "series": power_series(node.pk, hours, tdp_w, now),
        "daily": daily(node.pk, days, now.date()),
        "carbon": carbon.node_carbon(principal, node, factor, figures),
    }
