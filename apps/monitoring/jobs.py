"""Monitoring jobs: sampling each control-plane host, and the samples' retention."""

from __future__ import annotations

from celery import shared_task

from apps.core.guard import run_periodic
from apps.monitoring import hostmetrics

COLLECT = "monitoring.collect_server_metrics"
PRUNE = "monitoring.prune_server_metrics"


@shared_task(name=COLLECT)
def collect_server_metrics_job() -> str:
    from apps.monitoring.services import collect_server_metrics

    return run_periodic(COLLECT, collect_server_metrics, host=hostmetrics.host_name()).outcome


@shared_task(name=PRUNE)
def prune_server_metrics_job() -> str:
    from apps.monitoring.services import prune_server_metrics

    return run_periodic(PRUNE, prune_server_metrics).outcome
