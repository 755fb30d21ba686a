"""GET/PATCH /api/v1/gateway/routes/{service}: a service's priority and weight among the
services of its model name; scoped (another tenant's service is 404), strict, viewers
read only."""

import pytest

from apps.gateway.models import ServiceRoute
from apps.inference.models import InferenceService, Model
from apps.tasks.models import TaskGroup
from tests.headers import bearer

pytestmark = pytest.mark.django_db


@pytest.fixture
def service(world):
    tenant = world.tenants["acme"]
    model = Model.objects.create(tenant=tenant, name="qwen", source_kind="path", source="/m", format="gguf")
    group = TaskGroup.objects.create(
        tenant=tenant,
        name="qwen",
        kind="inference",
        placement="replicas",
        world_size=1,
        gpus_per_worker=1,
        gpu_type="nvidia",
    )
    return InferenceService.objects.create(group=group, model=model)


def test_read_and_change_a_services_route(api, world, service):
    url = f"/api/v1/gateway/routes/{service.pk}"
    assert api.get(url, **bearer(world.keys["acme-viewer"])).json() == {
        "service": service.pk,
        "model": "qwen",
        "priority": 0,
        "weight": 100,
    }
    assert api.patch(url, {"priority": 5}, format="json", **bearer(world.keys["acme-viewer"])).status_code == 403
    changed = api.patch(url, {"priority": 5, "weight": 10}, format="json", **bearer(world.keys["acme-member"]))
    assert changed.status_code == 200 and changed.json()["priority"] == 5 and changed.json()["weight"] == 10
    assert ServiceRoute.objects.get(service=service).weight == 10
    assert api.patch(url, {"weight": -1}, format="json", **bearer(world.keys["acme-member"])).status_code == 400
    assert api.patch(url, {"share": 1}, format="json", **bearer(world.keys["acme-member"])).status_code == 400
    assert api.get(url, **bearer(world.keys["beta-admin"])).status_code == 404
    assert api.patch(url, {"weight": 1}, format="json", **bearer(world.keys["beta-admin"])).status_code == 404
    assert ServiceRoute.objects.get(service=service).weight == 10
