"""Node jobs: the health checker and metrics retention."""

from __future__ import annotations

from apps.core.guard import periodic_job
from apps.nodes.metrics import prune_and_prepare_partitions
from apps.nodes.services import refresh_node_statuses

check_health_job = periodic_job("nodes.check_health", every=5)(refresh_node_statuses)
# also requested every 500 heartbeats (apps.nodes.api.heartbeat); the guard keeps it to
# once per period
prune_metrics_job = periodic_job("nodes.prune_metrics", every=600)(prune_and_prepare_partitions)
