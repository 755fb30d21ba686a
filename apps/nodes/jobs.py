"""Node jobs: the health checker, metrics retention, the image channel's janitor and the
memory drift check."""

from __future__ import annotations

from apps.core.guard import periodic_job
from apps.nodes.drift import check_memory_drift
from apps.nodes.images import sweep_image_requests
from apps.nodes.metrics import prune_and_prepare_partitions
from apps.nodes.services import refresh_node_statuses

check_health_job = periodic_job("nodes.check_health", every=5)(refresh_node_statuses)
# also requested every 500 heartbeats (apps.nodes.api.heartbeat); the guard keeps it to
# once per period
prune_metrics_job = periodic_job("nodes.prune_metrics", every=600)(prune_and_prepare_partitions)
# the image channel's janitor (apps.nodes.images, docs/images.md): stalled, over budget,
# pending on an offline node, and the finished requests past their retention
image_janitor_job = periodic_job("nodes.image_janitor", every=60)(sweep_image_requests)
# measured card memory the ledger does not explain (apps.nodes.drift): GPU_MEMORY_DRIFT
memory_drift_job = periodic_job("nodes.memory_drift", every=10)(check_memory_drift)
