"""The gateway in front of a service made the way users make them (apps.inference.services
.create_service: the group, the service, its replica tasks), its replicas placed as the
scheduler leaves them (running on a node with a host port, healthy by the heartbeat's
task_health) and served by stand-ins; and a sleeping service woken through the job the
gateway asks for by name (inference.wake_service)."""

import time

import httpx
import openai
import pytest
from django.conf import settings

from apps.core.enqueue import registered_task
from apps.gateway.api import route
from apps.inference import services as inference_services
from apps.inference.models import InferenceService
from apps.tasks.models import Task

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"name": "chat", "model": "qwen", "gpu_type": "nvidia", "gpus_per_replica": 1, "min_replicas": 2}


def created(tenancy, upstreams) -> InferenceService:
    tenancy.model("qwen")
    service = inference_services.create_service(tenancy.principal, dict(BODY))
    replicas = list(Task.objects.filter(group_id=service.pk).order_by("rank"))
    assert [t.rank for t in replicas] == [0, 1] and {t.kind for t in replicas} == {"inference"}
    for task, upstream in zip(replicas, (upstreams["a"], upstreams["b"]), strict=True):
        Task.objects.filter(pk=task.pk).update(status="running", node=tenancy.node, host_port=upstream.port)
    tenancy.node.task_health = [{"task_id": t.pk, "healthy": True} for t in replicas]
    tenancy.node.save(update_fields=["task_health"])
    return service


def test_a_created_service_is_served_by_its_replicas(gateway, upstreams, tenancy):
    created(tenancy, upstreams)
    _, key = tenancy.key()
    gateway.app.balancer, gateway.app.stickiness = "round_robin", False  # no session hashing: the turns alone
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=10)
        answers = [
            client.chat.completions.create(
                model="qwen", messages=[{"role": "user", "content": f"{i}"}]
            ).system_fingerprint
            for i in range(6)
        ]
        assert set(answers) == {"a", "b"}
        assert [m.id for m in client.models.list()] == ["qwen"]
    finally:
        gateway.app.balancer = "least_connections"
        gateway.app.stickiness = settings.HETEROFLOW_GATEWAY_STICKINESS


def test_a_sleeping_service_is_woken_by_the_job_the_gateway_names(gateway, upstreams, tenancy, monkeypatch):
    service = created(tenancy, upstreams)
    InferenceService.objects.filter(pk=service.pk).update(state="sleeping")
    Task.objects.filter(group_id=service.pk).update(status="stopped", host_port=None)
    _, key = tenancy.key()
    asked = []
    monkeypatch.setattr(route, "enqueue", lambda name, *args: asked.append((name, args)))
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"model": "qwen"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 503 and response.json()["error"]["code"] == "model_waking"
    deadline = time.monotonic() + 3
    while not asked and time.monotonic() < deadline:
        time.sleep(0.02)
    assert asked == [("inference.wake_service", (service.pk,))]
    name, args = asked[0]
    assert registered_task(name)(*args) == "woken"  # what a worker does with it
    service.refresh_from_db()
    assert service.state == "waking"
    assert set(Task.objects.filter(group_id=service.pk).values_list("status", flat=True)) == {"pending"}
