"""Memory-share replicas (spec 004 "推理显存比例共卡"): a service of gpus_per_replica 0
whose replicas are memory-only tasks (gpu_required 0, gpu_memory_mb), refused without
the memory, counted against the tenant's GPU memory quota as memory-only tasks are,
placed on one card's shares through the real cycle, and held to the slices' red line
(another tenant's share only within a tenant group)."""

import json

import pytest

from apps.core.errors import Conflict
from apps.inference.models import InferenceService, ServiceDecision
from apps.inference.services import scale_service, start_slots
from apps.nodes.models import Gpu
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.slices.models import Slice
from apps.tasks.models import Task, TaskGroup, TenantUsage
from apps.tasks.services import move_tasks
from apps.tenants.models import Tenant, TenantGroup
from tests.factories import make_node, make_task
from tests.headers import bearer
from tests.inference.service_rows import make_model

pytestmark = pytest.mark.django_db

URL = "/api/v1/inference-services"
SHARE = {
    "name": "small",
    "model": "qwen3-0.6b",
    "gpu_type": "nvidia",
    "gpus_per_replica": 0,
    "gpu_memory_mb": 20000,
    "min_replicas": 2,
    "max_replicas": 3,
}
H200 = {"model": "NVIDIA H200", "memory_total_mb": 143771}


@pytest.fixture
def model(world):
    return make_model(world.tenants["acme"], "qwen3-0.6b")


def post(api, world, body):
    return api.post(URL, body, format="json", **bearer(world.keys["acme-member"]))


def written():
    return (InferenceService.objects.count(), TaskGroup.objects.count(), Task.objects.count())


def software_card(node_id="box"):
    """A one-card node whose shares are software slices, born confirmed (a container)."""
    node = make_node(node_id, 1, **H200, is_container=True)
    Gpu.objects.filter(node=node).update(uuid=f"GPU-{node_id}-0")
    return node


@pytest.mark.parametrize("missing", [{}, {"gpu_memory_mb": None}])
def test_a_share_without_its_memory_is_400_and_writes_nothing(api, world, model, missing):
    body = {k: v for k, v in SHARE.items() if k != "gpu_memory_mb"} | missing
    before = written()
    response = post(api, world, body)
    assert response.status_code == 400, response.content
    (words,) = response.json()["error"]["fields"]["gpu_memory_mb"]
    assert words.startswith("Required with gpus_per_replica 0")
    assert written() == before


def test_a_share_service_has_memory_only_replicas(api, world, model):
    response = post(api, world, SHARE)
    assert response.status_code == 201, response.content
    answer = response.json()
    assert (answer["gpus_per_replica"], answer["gpu_memory_mb"]) == (0, 20000)
    service = InferenceService.objects.get(pk=answer["id"])
    assert service.memory_share and service.group.gpus_per_worker == 1
    replicas = Task.objects.filter(group_id=service.pk).order_by("rank")
    assert [(t.rank, t.gpu_required, t.gpu_memory_mb) for t in replicas] == [(0, 0, 20000), (1, 0, 20000)]
    (decision,) = ServiceDecision.objects.filter(service=service)
    assert decision.reason == "created with 2 replicas (2 × 20000 MB of one nvidia GPU)"
    # and a replica added by scaling is one of them
    assert scale_service(service, 3, source="user", reason="more")
    assert Task.objects.get(group_id=service.pk, rank=2).gpu_required == 0
    # a service of whole cards still reads as such
    whole = post(api, world, SHARE | {"name": "big", "gpus_per_replica": 2}).json()
    assert whole["gpus_per_replica"] == 2
    assert set(Task.objects.filter(group_id=whole["id"]).values_list("gpu_required", flat=True)) == {2}


def test_the_quota_counts_a_share_service_in_gpu_memory_not_gpus(api, world, model):
    acme = world.tenants["acme"]
    Tenant.objects.filter(pk=acme.pk).update(max_gpus=0, max_gpu_memory_mb=50000)
    before = TenantUsage.objects.filter(tenant=acme).values_list("gpus", "gpu_memory_mb").first() or (0, 0)
    assert post(api, world, SHARE).status_code == 201  # 2 × 20,000 MB, no GPU
    after = TenantUsage.objects.filter(tenant=acme).values_list("gpus", "gpu_memory_mb").get()
    assert after == (before[0], before[1] + 40000)
    counted = written()
    refused = post(api, world, SHARE | {"name": "more", "min_replicas": 1})  # 60,000 MB > 50,000
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "quota_exceeded"
    assert "GPU memory" in json.dumps(refused.json())
    assert written() == counted


def test_two_replicas_of_one_service_share_one_card_through_the_cycle(api, world, model):
    software_card()
    service_id = post(api, world, SHARE).json()["id"]
    replicas = list(Task.objects.filter(group_id=service_id).order_by("rank").values_list("pk", flat=True))
    assert sorted(run_cycle().bound) == replicas
    shares = GpuAllocation.objects.filter(task_id__in=replicas).order_by("task_id")
    assert [(a.node_id, a.gpu_index, a.memory_mb) for a in shares] == [("box", 0, 20000), ("box", 0, 20000)]
    slices = Slice.objects.filter(task_id__in=replicas)
    assert {(s.tier, s.state, s.memory_mb) for s in slices} == {("software", "confirmed", 20000)}
    assert set(Task.objects.filter(pk__in=replicas).values_list("status", flat=True)) == {"scheduled"}


@pytest.mark.parametrize("grouped", [False, True])
def test_another_tenants_share_joins_the_card_only_within_a_tenant_group(api, world, model, grouped):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    if grouped:
        TenantGroup.objects.create(name="acme-beta").tenants.add(acme, beta)
    software_card()
    service_id = post(api, world, SHARE | {"min_replicas": 1}).json()["id"]
    assert len(run_cycle().bound) == 1
    other = make_task(beta, name="beta-share", gpu_required=0, gpu_memory_mb=20000, gpu_type="nvidia")
    result = run_cycle()
    if grouped:
        assert result.bound == [other.pk]
        assert GpuAllocation.objects.filter(node_id="box", gpu_index=0).count() == 2
    else:
        assert result.bound == []
        other.refresh_from_db()
        assert other.status == "pending" and other.node_id is None
        assert GpuAllocation.objects.filter(node_id="box", gpu_index=0).get().task.group_id == service_id


def test_a_scale_up_over_the_gpu_memory_quota_is_refused_and_changes_nothing(api, world, model):
    acme = world.tenants["acme"]
    used = TenantUsage.objects.filter(tenant=acme).values_list("gpu_memory_mb", flat=True).first() or 0
    Tenant.objects.filter(pk=acme.pk).update(max_gpus=0, max_gpu_memory_mb=used + 50000)
    service = InferenceService.objects.get(pk=post(api, world, SHARE).json()["id"])  # 40,000 MB
    with pytest.raises(Conflict) as refused:
        scale_service(service, 3, source="user", reason="more")  # 60,000 MB
    assert refused.value.get_codes() == "quota_exceeded"
    assert InferenceService.objects.get(pk=service.pk).replicas == 2
    assert Task.objects.filter(group_id=service.pk).count() == 2


def test_a_replica_requeued_after_it_ended_is_still_a_share(api, world, model):
    software_card()
    service = InferenceService.objects.get(pk=post(api, world, SHARE | {"min_replicas": 1}).json()["id"])
    (first,) = run_cycle().bound
    assert move_tasks([first], ("scheduled",), "failed") == [first]  # a crash: the card's share given back
    assert not GpuAllocation.objects.filter(task_id=first).exists()
    assert start_slots(service, 1, why="rebuilt")["requeued"] == [first]
    again = Task.objects.get(pk=first)
    assert (again.status, again.gpu_required, again.gpu_memory_mb) == ("pending", 0, 20000)
    assert run_cycle().bound == [first]
    assert GpuAllocation.objects.get(task_id=first).memory_mb == 20000
