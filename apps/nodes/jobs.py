"""Node jobs: the health checker, metrics retention, the image channel's janitor, the
clean period of health cordons and the daily energy rollup. (Memory drift is judged in
the heartbeat itself: apps.nodes.drift.)"""

from __future__ import annotations

from celery import shared_task

from apps.core.guard import periodic_job
from apps.nodes.energy import roll_up_energy
from apps.nodes.gpu_health_services import recover_clean_cards
from apps.nodes.images import sweep_image_requests
from apps.nodes.metrics import PRUNE_EVERY_SECONDS, prune_and_prepare_partitions
from apps.nodes.services import refresh_node_statuses
from apps.tasks.services import record_card_losses

check_health_job = periodic_job("nodes.check_health", every=5)(refresh_node_statuses)
# the daily energy rollup (apps.nodes.energy): each accumulator's growth since the last
# run, added to today's (UTC) energy_daily row
energy_rollup_job = periodic_job("nodes.energy_rollup", every=300)(roll_up_energy)
# also requested by each web process once per period (apps.nodes.api.heartbeat); the
# guard keeps it to one run per period
prune_metrics_job = periodic_job("nodes.prune_metrics", every=PRUNE_EVERY_SECONDS)(prune_and_prepare_partitions)
# the image channel's janitor (apps.nodes.images, docs/images.md): stalled, over budget,
# pending on an offline node, and the finished requests past their retention
image_janitor_job = periodic_job("nodes.image_janitor", every=60)(sweep_image_requests)
# the clean period of health cordons (apps.nodes.gpu_health_services, docs/gpu-health.md):
# a no-op while HETEROFLOW_GPU_HEALTH_CLEAN_HOURS is 0
gpu_health_recovery_job = periodic_job("nodes.gpu_health_recovery", every=300)(recover_clean_cards)


@shared_task(name="nodes.record_card_losses")
def record_card_losses_job(node_id: str, cards: list) -> int:
    """Asked for by the heartbeat whose beat judged cards lost: a trace on their tasks."""
    return record_card_losses(node_id, [(int(index), str(basis)) for index, basis in cards])
