"""Admission on what is really free and cordoned cards through the real scheduler cycle
and the explain API (issue 21): a card's reading blocks what the ledger would admit, and
a cordoned card is skipped by whole-card, share and group placement (the end-to-end run
with heartbeats is test_admission_e2e.py)."""

import pytest

from apps.core.clock import utcnow
from apps.nodes.models import Gpu
from apps.scheduler import cycle
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.tasks.services import create_task
from tests.factories import make_group, make_node
from tests.headers import bearer

GB = 1024
TOTAL = 80 * GB


# --- the explain API ---------------------------------------------------------------------


@pytest.mark.django_db
def test_the_explain_api_shows_both_numbers_on_the_blocking_card(api, world):
    acme = world.tenants["acme"]
    make_node("n1", gpus=1, memory_total_mb=TOTAL)
    Gpu.objects.filter(node_id="n1").update(memory_used_mb=30 * GB)
    task = create_task(tenant=acme, name="t", image="x", gpu_required=1, gpu_memory_mb=60 * GB)
    run_cycle()
    answer = api.get(f"/api/v1/tasks/{task.pk}/explain", **bearer(world.keys["acme-member"])).json()
    assert answer["status"] == "pending" and answer["schedule_reason"]["removed_by"] == {"memory_in_use": 1}
    assert answer["now"]["placed"] is False
    assert answer["now"]["reason"]["cards"] == [
        {
            "node_id": "n1",
            "gpu_index": 0,
            "ledger_free_mb": TOTAL,
            "measured_free_mb": 50 * GB,
            "reserve_mb": 0,  # a whole card is the task's alone
            "needed_mb": 60 * GB,
        }
    ]
    # another tenant's task is not there at all
    assert api.get(f"/api/v1/tasks/{task.pk}/explain", **bearer(world.keys["beta-admin"])).status_code == 404
    # the dry run says the same
    dry = api.post(
        "/api/v1/scheduler/dry-run",
        {"gpu_required": 0, "gpu_memory_mb": 60 * GB},
        format="json",
        **bearer(world.keys["acme-member"]),
    ).json()
    assert dry["reason"]["removed_by"] == {"memory_in_use": 1}
    assert dry["reason"]["cards"][0]["reserve_mb"] == 8192
    Gpu.objects.filter(node_id="n1").update(memory_used_mb=1 * GB)
    answer = api.get(f"/api/v1/tasks/{task.pk}/explain", **bearer(world.keys["acme-member"])).json()
    assert answer["now"]["placed"] is True and answer["now"]["node_id"] == "n1"


@pytest.mark.django_db
def test_a_bound_task_has_nothing_to_explain_now(api, world):
    make_node("n1", gpus=1)
    task = create_task(tenant=world.tenants["acme"], name="t", image="x", gpu_required=1)
    assert run_cycle().bound == [task.pk]
    answer = api.get(f"/api/v1/tasks/{task.pk}/explain", **bearer(world.keys["acme-member"])).json()
    assert answer["status"] == "scheduled" and answer["now"] is None


# --- cordoned cards ------------------------------------------------------------------------


def cordon(node_id, index):
    Gpu.objects.filter(node_id=node_id, index=index).update(
        cordoned_at=utcnow(), cordon_source="operator", cordon_reason="test"
    )


@pytest.mark.django_db
def test_a_cordoned_card_is_skipped_by_whole_card_and_share_placement(world):
    acme = world.tenants["acme"]
    make_node("n1", gpus=2)
    cordon("n1", 0)
    pair = create_task(tenant=acme, name="pair", image="x", gpu_required=2)
    one = create_task(tenant=acme, name="one", image="x", gpu_required=1)
    result = run_cycle()
    assert result.bound == [one.pk] and result.failed[pair.pk]["removed_by"] == {"cordoned": 1}
    assert list(GpuAllocation.objects.filter(task=one).values_list("gpu_index", flat=True)) == [1]
    piece = create_task(tenant=acme, name="piece", image="x", gpu_required=0, gpu_memory_mb=10 * GB)
    result = run_cycle()
    assert result.failed[piece.pk]["removed_by"] == {"cordoned": 1}  # card 1 is taken whole; 0 is cordoned
    Gpu.objects.filter(node_id="n1").update(cordoned_at=None)
    assert run_cycle().bound == [piece.pk]
    assert GpuAllocation.objects.get(task=piece).gpu_index == 0


@pytest.mark.django_db
def test_a_cordoned_card_is_skipped_by_group_placement(world):
    acme = world.tenants["acme"]
    make_node("a", gpus=8)
    make_node("b", gpus=8)
    cordon("a", 3)
    group = make_group(acme, workers=2, gpus=8)
    result = run_cycle()
    assert result.groups_failed[group.pk]["removed_by"] == {"cordoned": 1}
    small = make_group(acme, workers=2, gpus=4, name="small")
    result = run_cycle()
    assert result.groups_bound == [small.pk]
    held = set(GpuAllocation.objects.filter(task__group=small).values_list("node_id", "gpu_index"))
    assert len(held) == 8 and ("a", 3) not in held


@pytest.mark.django_db
def test_bind_refuses_a_card_cordoned_after_the_snapshot(world, monkeypatch):
    acme = world.tenants["acme"]
    make_node("n1", gpus=1)
    task = create_task(tenant=acme, name="t", image="x", gpu_required=1)
    real = cycle.load_nodes

    def snapshot_then_cordon(*args, **kwargs):
        nodes = real(*args, **kwargs)
        cordon("n1", 0)  # the health step cordons the card while the cycle decides
        return nodes

    monkeypatch.setattr(cycle, "load_nodes", snapshot_then_cordon)
    result = run_cycle()
    assert result.bound == [] and result.lost_races == [task.pk]
    assert not GpuAllocation.objects.exists()
