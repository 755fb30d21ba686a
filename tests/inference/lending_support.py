"""What the lending tests start from: a service whose replicas the real cycle placed and
whose agent reports them running and healthy, the gateway's in-flight reading set, and
the agent's confirmations of a stop or a preemption."""

from __future__ import annotations

from apps.core.clock import utcnow
from apps.inference import load_readings, services
from apps.inference.models import InferenceService
from apps.nodes.models import Node
from apps.scheduler.cycle import run_cycle
from apps.tasks.models import Task
from apps.tasks.services import agent_report
from tests.inference.services_helpers import make_service


def wipe_signals() -> None:
    with load_readings.client() as redis:
        keys = list(redis.scan_iter("hf:svc:*"))
        if keys:
            redis.delete(*keys)


def in_flight(service, count: int | None) -> None:
    """The gateway's in-flight reading of the service (None: no reading)."""
    with load_readings.client() as redis:
        if count is None:
            redis.delete(load_readings.inflight_key(service.pk))
        else:
            redis.set(load_readings.inflight_key(service.pk), count)


def serving(world, slug: str = "acme", *, replicas: int, name: str = "chat", **fields) -> InferenceService:
    """A running service of `replicas` one-card replicas, placed by the cycle and reported
    running and healthy by their agent, idle (0 in flight)."""
    fields = {"gpus_per_replica": 1, "min_replicas": replicas, "max_replicas": replicas, **fields}
    service = make_service(world, slug, name=name, **fields)
    if service.replicas < replicas:
        assert services.scale_service(service, replicas, source="user", reason="the test's count")
    run_cycle()
    replicas_up(service)
    InferenceService.objects.filter(pk=service.pk).update(state="running")
    in_flight(service, 0)
    return InferenceService.objects.select_related("group", "model").get(pk=service.pk)


def replicas_up(service) -> list[Task]:
    """Every placed replica of the service reported running and healthy by its node."""
    up = []
    for task in Task.objects.filter(group_id=service.pk, status__in=("scheduled", "starting")).order_by("rank"):
        assert agent_report(task, from_status=task.status, to_status="running")
        up.append(task)
    for node_id in set(Task.objects.filter(group_id=service.pk, status="running").values_list("node_id", flat=True)):
        ids = Task.objects.filter(group_id=service.pk, status="running", node_id=node_id).values_list("pk", flat=True)
        node = Node.objects.get(pk=node_id)
        health = [entry for entry in node.task_health or [] if entry["task_id"] not in set(ids)]
        Node.objects.filter(pk=node_id).update(
            task_health=[*health, *({"task_id": pk, "healthy": True} for pk in ids)], last_heartbeat_at=utcnow()
        )
    return up


def confirm(task_id: int, from_status: str, to_status: str) -> None:
    """The agent's report that a stop (or a preemption) is done."""
    task = Task.objects.get(pk=task_id)
    assert agent_report(task, from_status=from_status, to_status=to_status), (task.status, from_status)


def service(pk) -> InferenceService:
    return InferenceService.objects.select_related("group", "model").get(pk=pk)
