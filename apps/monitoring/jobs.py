"""Monitoring jobs: sampling each control-plane host, and the samples' retention."""

from __future__ import annotations

from apps.core.guard import periodic_job
from apps.monitoring import hostmetrics
from apps.monitoring.services import collect_server_metrics, prune_server_metrics

# Sampling is about the host that runs it: every worker sends it to its own host's queue.
collect_server_metrics_job = periodic_job(
    "monitoring.collect_server_metrics", every=30, host_name=hostmetrics.host_name
)(collect_server_metrics)
prune_server_metrics_job = periodic_job("monitoring.prune_server_metrics", every=3600)(prune_server_metrics)
