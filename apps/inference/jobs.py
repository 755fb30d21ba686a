"""The inference services' jobs: the rebuild (every 10 s), the AutoScaler with the sleep
checks (every 30 s), the scheduling windows (every 60 s) and the wake patrol of the
cards lent to training (every 15 s), each under the guard
(apps.core.guard; beat's schedule is built from these declarations), and the wake the
gateway asks for a sleeping service: `enqueue("inference.wake_service", service_id)`."""

from __future__ import annotations

from celery import shared_task

from apps.core.errors import Conflict
from apps.core.guard import periodic_job
from apps.inference import services
from apps.inference.lending import patrol_round
from apps.inference.models import InferenceService
from apps.inference.rounds import autoscale_round, rebuild_round, windows_round

rebuild_job = periodic_job("inference.rebuild", every=10)(rebuild_round)
autoscale_job = periodic_job("inference.autoscale", every=30)(autoscale_round)
windows_job = periodic_job("inference.windows", every=60)(windows_round)
# the wake patrol of training's loans of idle inference cards (spec 004, "训练借卡唤醒巡检 15s")
lending_patrol_job = periodic_job("inference.lending_patrol", every=15)(patrol_round)


@shared_task(name="inference.wake_service")
def wake_service_job(service_id: int) -> str:
    """Wake a sleeping service for a request through the gateway: "woken" (sleeping →
    waking, its replicas queued again), "awake" (running, starting or waking already:
    nothing to do), "gone", or the Conflict's code (a paused or stopped service, or no
    quota for its replicas now)."""
    service = InferenceService.objects.select_related("group").filter(pk=service_id).first()
    if service is None:
        return "gone"
    was = service.state
    try:
        services.wake(service, source="wake", reason="a request through the gateway")
    except Conflict as exc:
        return str(exc.get_codes())
    return "woken" if was == "sleeping" else "awake"
