"""Inference services written as rows, past the services (as tests/factories.py does for
tasks and groups), so an API or page test can start from any state: a model, a service on
its group with `replicas` replica tasks (ranks 0…n-1) in any status, on any node."""

from __future__ import annotations

from apps.inference.models import InferenceService, Model, ServiceDecision
from tests.factories import make_group


def make_model(tenant, name: str = "qwen3-8b", **fields) -> Model:
    return Model.objects.create(
        tenant=tenant,
        name=name,
        **{"source_kind": "path", "source": f"/models/{name}", "format": "safetensors", **fields},
    )


def make_service(
    tenant,
    model: Model | None = None,
    *,
    name: str = "chat",
    replicas: int = 2,
    status: str = "pending",
    node=None,
    gpus: int = 1,
    **fields,
) -> InferenceService:
    """A service of `replicas` replicas whose tasks are all in `status` (on `node`, with
    host ports 8000, 8001… when placed); `fields` are the service's other columns."""
    model = model or make_model(tenant)
    placed = node is not None and status != "pending"
    group = make_group(
        tenant,
        replicas,
        gpus,
        kind="inference",
        placement="replicas",
        name=name,
        image="auto",
        members=lambda rank: {
            "status": status,
            "node": node if status != "pending" else None,
            "host_port": 8000 + rank if placed else None,
            "serving": {"engine": "auto", "model": model.name, "format": model.format, "source": model.source},
        },
    )
    fields = {"min_replicas": 1, "max_replicas": max(replicas, 1), "replicas": replicas, **fields}
    service = InferenceService.objects.create(group=group, model=model, **fields)
    return service


def decide(service, source: str = "autoscaler", action: str = "scale_up", reason: str = "r", **fields):
    return ServiceDecision.objects.create(service=service, source=source, action=action, reason=reason, **fields)
