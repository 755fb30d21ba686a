"""A memory-only task's slice at bind (apps.scheduler.services.bind_all with
apps.slices.ledger.plan_carves / carve) and its release through move_tasks, against the
database: the tier derived from the card, the slice and its create request in the
bind's transaction, a MIG card with no profile left, the cross-tenant rule on slices."""

from unittest import mock

import pytest

from apps.nodes.models import Gpu
from apps.scheduler.core import PluginSettings, place
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import bind_all, load_nodes, next_batch, run_cycle, sharing_rule
from apps.scheduler.snapshot import GpuRowCache
from apps.slices.models import Slice, SliceRequest
from apps.tasks.models import Task
from apps.tasks.services import agent_report, move_tasks, stop_task
from apps.tenants.models import TenantGroup
from apps.tenants.services import create_tenant
from tests.factories import make_node, make_task

pytestmark = pytest.mark.django_db

H200 = {"model": "NVIDIA H200", "memory_total_mb": 143771}
MIG = {"mig_capable": True, "mps_capable": False, "best_tier": 1}


def mig_node(node_id="n1", gpus=1, **fields):
    node = make_node(node_id, gpus, **H200, gpu_capabilities={str(i): MIG for i in range(gpus)}, **fields)
    node.gpus.update(uuid=node_id + "-gpu")
    return node


def share(tenant, memory=20000, **fields):
    return make_task(tenant, gpu_required=0, gpu_memory_mb=memory, **fields)


def test_bind_carves_a_mig_slice_and_issues_its_create_in_the_same_transaction(world):
    mig_node()
    task = share(world.tenants["acme"])
    assert run_cycle().bound == [task.pk]
    task.refresh_from_db()
    assert (task.status, task.node_id) == ("scheduled", "n1")
    (allocation,) = GpuAllocation.objects.filter(task=task)
    assert allocation.memory_mb == 35840  # the profile's memory, not the 20,000 asked
    (slice_,) = Slice.objects.filter(task=task)
    assert (slice_.tier, slice_.profile, slice_.memory_mb, slice_.compute_percent) == ("mig", "1g.35gb", 35840, 14)
    assert (slice_.state, slice_.gpu_index, slice_.gpu_uuid, slice_.tenant_id) == (
        "requested",
        0,
        "n1-gpu",
        task.tenant_id,
    )
    assert slice_.reason["qos"] == "gold" and "MIG mode enabled" in slice_.reason["why"]
    (request,) = SliceRequest.objects.filter(slice=slice_)
    assert (request.action, request.vendor, request.status, request.node_id) == (
        "create",
        "nvidia-mig",
        "pending",
        "n1",
    )
    assert request.params["profile"] == "1g.35gb" and request.params["gpu_index"] == 0


def test_a_failure_in_the_bind_leaves_neither_the_task_moved_nor_a_slice(world):
    mig_node()
    task = share(world.tenants["acme"])
    with mock.patch("apps.slices.ledger.issue", side_effect=RuntimeError("the request's insert failed")):
        with pytest.raises(RuntimeError):
            run_cycle()
    task.refresh_from_db()
    assert task.status == "pending" and task.node_id is None
    assert not Slice.objects.exists() and not SliceRequest.objects.exists()
    assert not GpuAllocation.objects.exists()
    assert run_cycle().bound == [task.pk]  # and the next cycle binds it whole


def test_a_full_mig_card_is_not_chosen_and_the_task_waits_with_the_reason(world):
    acme = world.tenants["acme"]
    mig_node("full")
    make_node("other", 1, model="NVIDIA H200", memory_total_mb=143771)  # not in MIG mode: software
    first = share(acme, memory=144000, name="whole card")
    assert run_cycle().bound == [first.pk]
    assert Task.objects.get(pk=first.pk).node_id == "full"  # 7g.141gb
    second = share(acme, memory=10000)
    run_cycle()
    second.refresh_from_db()
    assert second.node_id == "other"  # not the MIG card: no profile left there
    third = share(acme, memory=10000, name="third")
    Task.objects.filter(pk=second.pk).update(gpu_memory_mb=120000)
    GpuAllocation.objects.filter(task=second).update(memory_mb=120000)  # the software card is full too
    result = run_cycle()
    third.refresh_from_db()
    assert third.status == "pending" and result.failed[third.pk]["code"] == "InsufficientResources"
    assert third.schedule_reason["removed_by"] == {"capacity": 2}


def test_one_cycle_carves_a_mig_card_full_and_no_further(world):
    mig_node()
    tasks = [share(world.tenants["acme"], memory=18000, name=f"s{k}") for k in range(8)]
    result = run_cycle()
    assert sorted(result.bound) == sorted(t.pk for t in tasks[:7])  # 7 × 1g.18gb
    assert result.failed[tasks[7].pk]["removed_by"] == {"capacity": 1}
    assert sorted(Slice.objects.values_list("profile", flat=True)) == ["1g.18gb"] * 7
    assert SliceRequest.objects.filter(action="create", status="pending").count() == 7


def test_a_slice_that_can_no_longer_be_planned_at_bind_drops_the_decision(world):
    acme = world.tenants["acme"]
    node = mig_node()
    task = share(acme)
    (request,) = next_batch()
    decisions, failures = place([request], load_nodes(), PluginSettings(), sharing_rule())  # on this snapshot…
    assert decisions and not failures
    # …and meanwhile the card was carved whole (an orphan found on it, say)
    Slice.objects.create(node=node, gpu_index=0, tier="mig", memory_mb=144384, profile="7g.141gb", state="orphaned")
    bound, lost = bind_all(decisions, {task.pk: request}, sharing_rule())
    assert (bound, lost) == ([], [task.pk])
    task.refresh_from_db()
    assert task.status == "pending" and task.schedule_reason["code"] == "SliceUnplannable"
    assert "no MIG profile of 20000 MB or more left" in task.schedule_reason["message"]
    assert not GpuAllocation.objects.exists() and not Slice.objects.filter(task=task).exists()


def test_a_container_node_gets_a_software_slice_born_confirmed(world):
    make_node("box", 1, **H200, is_container=True, gpu_capabilities={"0": MIG})  # a claim the server ignores
    Gpu.objects.filter(node_id="box").update(uuid="GPU-box-0")
    task = share(world.tenants["acme"], memory=30000)
    assert run_cycle().bound == [task.pk]
    (slice_,) = Slice.objects.filter(task=task)
    assert (slice_.tier, slice_.state, slice_.device_id, slice_.memory_mb, slice_.profile) == (
        "software",
        "confirmed",
        "GPU-box-0",
        30000,
        "",
    )
    assert slice_.compute_percent is None and slice_.confirmed_at is not None
    assert "runs in a container" in slice_.reason["why"] and slice_.reason["qos"] == "bronze"
    assert not SliceRequest.objects.exists()
    assert GpuAllocation.objects.get(task=task).memory_mb == 30000


def test_an_mps_card_gets_limits_proportional_to_the_memory(world):
    make_node("mps", 1, memory_total_mb=81920, gpu_capabilities={"0": {"mig_capable": False, "mps_capable": True}})
    task = share(world.tenants["acme"], memory=20480)
    run_cycle()
    (slice_,) = Slice.objects.filter(task=task)
    assert (slice_.tier, slice_.state, slice_.compute_percent, slice_.memory_mb) == ("mps", "requested", 25, 20480)
    assert SliceRequest.objects.get(slice=slice_).vendor == "nvidia-mps"


def test_whole_card_tasks_get_no_slice(world):
    mig_node()
    task = make_task(world.tenants["acme"], gpu_required=1)
    assert run_cycle().bound == [task.pk]
    assert not Slice.objects.exists()


# --- released through move_tasks -------------------------------------------------------


def test_a_software_slice_is_released_when_its_task_completes(world):
    make_node("plain", 1)
    task = share(world.tenants["acme"])
    run_cycle()
    task.refresh_from_db()
    assert agent_report(task, from_status="scheduled", to_status="running")
    assert agent_report(task, from_status="running", to_status="completed", exit_code=0)
    slice_ = Slice.objects.get(task=task)
    assert slice_.state == "released" and slice_.released_at is not None
    assert not GpuAllocation.objects.exists()


def test_a_confirmed_mig_slice_goes_releasing_with_a_destroy_request_and_keeps_its_room(world):
    acme = world.tenants["acme"]
    mig_node()
    task = share(acme, memory=144000)
    run_cycle()
    slice_ = Slice.objects.get(task=task)
    SliceRequest.objects.filter(slice=slice_).update(status="completed")
    Slice.objects.filter(pk=slice_.pk).update(state="confirmed", device_id="MIG-1", handles={"gi": 0, "ci": 0})
    task.refresh_from_db()
    assert agent_report(task, from_status="scheduled", to_status="running")
    assert agent_report(task, from_status="running", to_status="completed", exit_code=0)
    slice_.refresh_from_db()
    assert slice_.state == "releasing"
    destroy = SliceRequest.objects.get(slice=slice_, status="pending")
    assert destroy.action == "destroy" and destroy.params["device_id"] == "MIG-1"
    assert not GpuAllocation.objects.exists()  # the ledger is given back…
    later = share(acme, memory=1000, name="later")
    result = run_cycle()
    assert result.failed[later.pk]["removed_by"] == {"capacity": 1}  # …but the instance is still on the card
    Slice.objects.filter(pk=slice_.pk).update(state="released")
    assert run_cycle().bound == [later.pk]


def test_a_requested_slice_is_withdrawn_when_its_task_is_cancelled(world):
    mig_node()
    task = share(world.tenants["acme"])
    run_cycle()
    task.refresh_from_db()
    stop_task(task)
    slice_ = Slice.objects.get(task=task)
    assert slice_.state == "failed"
    assert SliceRequest.objects.get(slice=slice_).status == "failed"


def test_a_requeued_task_is_carved_anew(world):
    mig_node()
    task = share(world.tenants["acme"])
    run_cycle()
    assert move_tasks(task.pk, ["scheduled"], "pending", node=None)
    assert run_cycle().bound == [task.pk]
    states = sorted(Slice.objects.filter(task=task).values_list("state", flat=True))
    assert states == ["failed", "requested"]


# --- the cross-tenant rule on slices ----------------------------------------------------


def occupy(node, tenant, memory=18000):
    """A task of `tenant` already on card 0 of `node` with its MIG slice."""
    holder = share(tenant, memory=memory, name=f"holder-{tenant.slug}", status="running", node=node)
    GpuAllocation.objects.create(task=holder, node=node, gpu_index=0, tenant=tenant, memory_mb=18432)
    Slice.objects.create(
        node=node, gpu_index=0, tenant=tenant, task=holder, tier="mig", memory_mb=18432, profile="1g.18gb",
        state="confirmed",
    )  # fmt: skip
    return holder


def beta_and_group(world, grouped: bool):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    if grouped:
        TenantGroup.objects.create(name="acme-beta").tenants.add(acme, beta)
    return acme, beta


@pytest.mark.parametrize("grouped", [False, True])
def test_a_slice_shares_a_card_with_another_tenant_only_within_a_tenant_group(world, grouped):
    acme, beta = beta_and_group(world, grouped)
    occupy(mig_node("shared"), beta)
    mine = share(acme)
    result = run_cycle()
    if grouped:
        assert result.bound == [mine.pk]
        assert Slice.objects.get(task=mine).profile == "1g.35gb"
    else:  # fail-closed: no common group, no sharing
        assert result.failed[mine.pk]["code"] == "NoTenantEligibleGPU"
        assert result.failed[mine.pk]["removed_by"] == {"tenant_sharing": 1}


def test_one_occupant_outside_the_group_is_enough_to_refuse_the_card(world):
    acme, beta = beta_and_group(world, grouped=True)
    gamma = create_tenant(name="Gamma", slug="gamma")
    card = mig_node("crowded")
    occupy(card, beta)
    occupy(card, gamma)
    mine = share(acme)
    assert run_cycle().failed[mine.pk]["code"] == "NoTenantEligibleGPU"
    own = share(gamma, name="gamma's own")  # gamma may join its own card (beta is not in its group: no)
    assert run_cycle().failed[own.pk]["code"] == "NoTenantEligibleGPU"
    assert not Slice.objects.filter(task__in=[mine, own]).exists()


# --- the scheduler's snapshot ---------------------------------------------------------


def test_the_snapshot_reads_mig_cards_and_what_their_live_slices_take(world):
    gpu_rows = GpuRowCache()  # the GPU rows a process reuses
    node = mig_node("m", gpus=2)
    make_node("c", 1, **H200, is_container=True, gpu_capabilities={"0": MIG})
    Slice.objects.create(node=node, gpu_index=0, tier="mig", memory_mb=72704, profile="3g.71gb", state="orphaned")
    Slice.objects.create(node=node, gpu_index=0, tier="mig", memory_mb=18432, profile="1g.18gb", state="released")
    for _ in range(2):  # the second reuses the GPU rows: the carving is read again, not added up
        cards = {(n.id, g.index): g for n in load_nodes(reuse_seconds=60, gpu_rows=gpu_rows) for g in n.gpus}
        first, second, boxed = cards[("m", 0)], cards[("m", 1)], cards[("c", 0)]
        assert (first.mig, first.mig_model.key, first.carved_g, first.carved_memory) == (True, "H200 141GB", 3, 4)
        assert first.holders == [(0, None, 72704)]  # the orphan: room taken, nobody's
        assert (second.mig, second.carved_g, second.holders) == (True, 0, [])
        assert not boxed.mig  # a container node never carves MIG, whatever it reports
