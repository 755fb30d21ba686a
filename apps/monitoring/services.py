"""State changes of the monitoring app: recording host samples and their retention."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection

from apps.core.clock import utcnow
from apps.monitoring import hostmetrics
from apps.monitoring.models import ServerMetric

PRUNE_BATCH = 10_000
PRUNE_MAX_BATCHES = 100  # a run deletes at most a million rows; the next run goes on


def previous_sample(host: str, before: datetime) -> ServerMetric | None:
    return (
        ServerMetric.objects.filter(host=host, at__lt=before)
        .order_by("-at")
        .only("at", "net_recv_bytes", "net_sent_bytes")
        .first()
    )


def record_sample(host: str, sample: hostmetrics.HostSample, at: datetime) -> ServerMetric:
    """Store one sample of `host`, with the network rates since that host's previous one."""
    previous = previous_sample(host, at)
    before = (previous.net_recv_bytes, previous.net_sent_bytes, previous.at) if previous else (None, None, None)
    return ServerMetric.objects.create(
        host=host,
        at=at,
        **sample.as_dict(),
        net_recv_bytes_per_second=hostmetrics.byte_rate(before[0], before[2], sample.net_recv_bytes, at),
        net_sent_bytes_per_second=hostmetrics.byte_rate(before[1], before[2], sample.net_sent_bytes, at),
    )


def collect_server_metrics(now: datetime | None = None, read=hostmetrics.read_host) -> int:
    """Sample this host (the CPU over up to a second) and store it; returns the row id."""
    sample, _window = read()
    return record_sample(hostmetrics.host_name(), sample, now or utcnow()).pk


def prune_server_metrics(now: datetime | None = None, retention_hours: int | None = None) -> int:
    """Delete samples older than the retention, in bounded batches; returns how many."""
    now = now or utcnow()
    cutoff = now - timedelta(hours=retention_hours or settings.HETEROFLOW_SERVER_METRICS_RETENTION_HOURS)
    deleted = 0
    with connection.cursor() as cursor:
        for _ in range(PRUNE_MAX_BATCHES):
            cursor.execute(
                "DELETE FROM server_metrics WHERE id IN (SELECT id FROM server_metrics WHERE at < %s LIMIT %s)",
                [cutoff, PRUNE_BATCH],
            )
            deleted += cursor.rowcount
            if cursor.rowcount < PRUNE_BATCH:
                break
    return deleted
