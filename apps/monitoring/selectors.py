"""Reads of the monitoring app: host history and live readings, the cluster snapshot
behind /metrics and the health checks, and the caller-scoped health detail."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Count, F, Min, Q

from apps.alerts.choices import AlertState
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.core.models import JobRun
from apps.monitoring import hostmetrics, probes
from apps.monitoring.models import ServerMetric
from apps.monitoring.services import previous_sample
from apps.nodes.choices import ALIVE, NodeStatus
from apps.nodes.gpu_state import state_sql
from apps.nodes.models import Gpu, Node
from apps.scheduler.plugins import plugin_table
from apps.tasks.choices import ACTIVE, TaskStatus
from apps.tasks.models import Task

# --- host history ---------------------------------------------------------------------

HISTORY_MIN_HOURS, HISTORY_MAX_HOURS = 1, 168
# (up to this many hours, bucket seconds): 1 h per minute, 6 h per 5 min, 24 h per
# 15 min, 7 days per hour; a window in between takes the next rung up.
HISTORY_BUCKETS = ((1, 60), (6, 300), (24, 900), (168, 3600))

HISTORY_SQL = """
    SELECT host, to_timestamp(floor(extract(epoch FROM at) / %(step)s) * %(step)s) AS bucket, count(*),
           avg(cpu_percent), avg(memory_percent), avg(disk_percent), avg(load_1), avg(load_5), avg(load_15),
           avg(net_recv_bytes_per_second), avg(net_sent_bytes_per_second), max(net_recv_bytes), max(net_sent_bytes),
           avg(cpu_temperature_celsius), max(cpu_temperature_celsius)
    FROM server_metrics
    WHERE at > %(since)s AND at <= %(until)s {host_filter}
    GROUP BY host, bucket ORDER BY host, bucket
"""
HISTORY_FIELDS = (
    "samples",
    "cpu_percent",
    "memory_percent",
    "disk_percent",
    "load_1",
    "load_5",
    "load_15",
    "net_recv_bytes_per_second",
    "net_sent_bytes_per_second",
    "net_recv_bytes",
    "net_sent_bytes",
    "cpu_temperature_celsius",
    "cpu_temperature_max_celsius",
)


def bucket_seconds(hours: int) -> int:
    return next(step for limit, step in HISTORY_BUCKETS if hours <= limit)


def _rounded(value):
    return round(value, 3) if isinstance(value, float) else value


def history(hours: int, *, host: str = "", now: datetime | None = None) -> dict:
    """Samples of the last `hours`, averaged per bucket, one series per host (counters:
    the bucket's last value; temperature: null where the host has no sensor)."""
    now = now or utcnow()
    step = bucket_seconds(hours)
    since = now - timedelta(hours=hours)
    params = {"step": step, "since": since, "until": now, "host": host}
    with connection.cursor() as cursor:
        cursor.execute(HISTORY_SQL.format(host_filter="AND host = %(host)s" if host else ""), params)
        rows = cursor.fetchall()
    series = defaultdict(list)
    for host_name, bucket, *values in rows:
        series[host_name].append(
            {"at": bucket, **{name: _rounded(value) for name, value in zip(HISTORY_FIELDS, values, strict=True)}}
        )
    return {
        "hours": hours,
        "bucket_seconds": step,
        "since": since,
        "until": now,
        "hosts": [{"host": name, "points": points} for name, points in series.items()],
    }


LATEST_WITHIN = timedelta(hours=1)
LATEST_MAX_HOSTS = 50


def latest_samples(*, within: timedelta = LATEST_WITHIN, now: datetime | None = None) -> list[ServerMetric]:
    """The newest stored sample of each host that sampled within `within` (a host silent
    for longer has gone: stopped, or a container recreated under a new name), by host.
    One index-backed query; at most LATEST_MAX_HOSTS hosts."""
    now = now or utcnow()
    latest = ServerMetric.objects.filter(at__gt=now - within, at__lte=now).order_by("host", "-at").distinct("host")
    return list(latest[:LATEST_MAX_HOSTS])


def live(now: datetime | None = None) -> dict:
    """This host now. Network rates are since this host's last stored sample."""
    sample, cpu_window = hostmetrics.read_host()
    now = now or utcnow()
    host = hostmetrics.host_name()
    previous = previous_sample(host, now)
    since = previous.at if previous else None
    return {
        "host": host,
        "at": now,
        **hostmetrics.platform_facts(),
        **sample.as_dict(),
        "cpu_window_seconds": cpu_window,
        "net_recv_bytes_per_second": hostmetrics.byte_rate(
            previous and previous.net_recv_bytes, since, sample.net_recv_bytes, now
        ),
        "net_sent_bytes_per_second": hostmetrics.byte_rate(
            previous and previous.net_sent_bytes, since, sample.net_sent_bytes, now
        ),
        "net_rate_since": since,
    }


# --- the cluster, for /metrics and the health checks -------------------------------------


def nodes_by_status_and_gpu_type() -> list[tuple[str, str, int]]:
    return list(Node.objects.order_by().values_list("status", "gpu_type").annotate(n=Count("id")))


GPU_STATES_SQL = f"""
    SELECT g.vendor, {state_sql("g")} AS state, count(*)
    FROM gpus g GROUP BY 1, 2
"""


def gpus_by_type_and_state() -> list[tuple[str, str, int]]:
    with connection.cursor() as cursor:
        cursor.execute(GPU_STATES_SQL)
        return cursor.fetchall()


def active_alerts_by_type_and_severity() -> list[tuple[str, str, int]]:
    return list(
        Alert.objects.filter(state=AlertState.ACTIVE).order_by().values_list("type", "severity").annotate(n=Count("id"))
    )


def task_queue(now: datetime | None = None) -> dict:
    """Active tasks by status, and the age of the oldest pending one (None: none pending)."""
    now = now or utcnow()
    by_status = dict(Task.objects.filter(status__in=ACTIVE).order_by().values_list("status").annotate(n=Count("id")))
    oldest = Task.objects.filter(status=TaskStatus.PENDING).aggregate(oldest=Min("created_at"))["oldest"]
    return {
        "by_status": {status: by_status.get(status, 0) for status in ACTIVE},
        "pending": by_status.get(TaskStatus.PENDING, 0),
        "oldest_pending_age_seconds": max(0.0, (now - oldest).total_seconds()) if oldest else None,
    }


def job_runs() -> list[tuple[str, datetime | None, str]]:
    return list(JobRun.objects.values_list("key", "last_finished_at", "last_outcome"))


def gpu_nodes_online() -> int:
    return Node.objects.filter(status=NodeStatus.ONLINE, gpu_count__gt=0).count()


# --- the caller-scoped health detail -------------------------------------------------------


def health_detail_for(principal, now: datetime | None = None) -> dict:
    """What the status bar shows, narrowed to the caller: GPUs of the nodes they may see
    (online ones counted apart), their own tasks, and the scheduler's plugins for
    operators only."""
    now = now or utcnow()
    nodes = Node.objects.visible_to(principal)
    gpus = Gpu.objects.filter(node__in=nodes)
    gpu_counts = gpus.aggregate(
        total=Count("id"),
        online=Count("id", filter=Q(node__status__in=ALIVE, lost_at__isnull=True)),
        lost=Count("id", filter=Q(lost_at__isnull=False)),
    )
    busy = gpus.filter(lost_at__isnull=True, node__allocations__gpu_index=F("index")).distinct().count()
    by_status = dict(Task.objects.visible_to(principal).order_by().values_list("status").annotate(n=Count("id")))
    database_ok = probes.database_answers()
    scheduler = probes.scheduler_state(now) if database_ok else "unknown"
    detail = {
        "status": "unhealthy" if not database_ok else ("ok" if scheduler == "running" else "degraded"),
        "checks": {
            "database": "ok" if database_ok else "unreachable",
            "scheduler": scheduler,
            "gpu_resources": {
                **gpu_counts,
                "busy": busy,
                "nodes": nodes.count(),
                "nodes_online": nodes.filter(status__in=ALIVE).count(),
            },
            "tasks": {
                "total": sum(by_status.values()),
                "running": by_status.get(TaskStatus.RUNNING, 0),
                "pending": by_status.get(TaskStatus.PENDING, 0),
                "by_status": {status: by_status.get(status, 0) for status in TaskStatus.values},
            },
        },
    }
    if principal.is_operator:
        detail["checks"]["plugins"] = plugin_table()
    return detail
