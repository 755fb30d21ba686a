"""Node jobs: the health checker, metrics retention, and the hooks the heartbeat uses."""

from __future__ import annotations

import logging

from celery import shared_task
from django.core.cache import cache

from apps.core.guard import run_periodic

logger = logging.getLogger(__name__)

NODE_ADDRESS_CACHE_KEY = "node-address:{node_id}"


def forget_node_address(node_id: str) -> None:
    """A node's public IP changed: whatever caches its address (the gateway's backend
    table) must look it up again."""
    try:
        cache.delete(NODE_ADDRESS_CACHE_KEY.format(node_id=node_id))
    except Exception:  # Redis holds nothing that cannot be lost
        logger.warning("could not invalidate the cached address of node %s", node_id)


def request_metrics_prune() -> None:
    try:
        prune_metrics_job.delay()
    except Exception:
        logger.warning("could not queue the node metrics clean-up; the next trigger will")


@shared_task(name="nodes.check_health")
def check_health_job() -> str:
    from apps.nodes.services import refresh_node_statuses

    return run_periodic("nodes.check_health", refresh_node_statuses).outcome


@shared_task(name="nodes.prune_metrics")
def prune_metrics_job() -> str:
    from apps.nodes.metrics import prune_and_prepare_partitions

    return run_periodic("nodes.prune_metrics", prune_and_prepare_partitions).outcome
