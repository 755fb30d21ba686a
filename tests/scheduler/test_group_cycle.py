"""Task groups through the scheduler's shell: placed and bound whole in one cycle, or
not at all; explained on the group and its members."""

import pytest

from apps.scheduler import bind
from apps.scheduler.core import Decision, GroupDecision, PluginSettings
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import bind_all, run_cycle
from apps.tasks.models import Task, TaskGroup
from tests.factories import make_group, make_node, make_task, make_task_holding
from tests.scheduler.ledger import ledger_agrees
from tests.scheduler.snapshots import SAME_TENANT_ONLY, task

pytestmark = pytest.mark.django_db


def members(group):
    return list(Task.objects.filter(group=group).order_by("rank"))


def test_a_group_is_bound_whole_in_one_cycle(world):
    acme = world.tenants["acme"]
    for n in range(2):
        make_node(f"n{n}", gpus=8, zone="z1", rack="r1")
    group = make_group(acme, workers=4, gpus=4, strategy="ddp")
    result = run_cycle()
    assert result.groups_bound == [group.pk]
    ranks = members(group)
    assert sorted(result.bound) == [t.pk for t in ranks]
    assert [t.status for t in ranks] == ["scheduled"] * 4
    assert [t.node_id for t in ranks] == ["n0", "n0", "n1", "n1"]  # packed, rank 0 on the master's node
    assert GpuAllocation.objects.filter(task__group=group).count() == 16
    group.refresh_from_db()
    assert (group.status, group.attempts, group.schedule_reason) == ("scheduled", 1, {})
    assert ledger_agrees()


def test_a_group_that_does_not_fit_binds_nothing_and_says_why(world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=8)
    make_node("n1", gpus=4)
    group = make_group(acme, workers=4, gpus=4)
    single = make_task(acme, gpu_required=4, priority=10)
    result = run_cycle()
    assert result.groups_bound == [] and result.bound == [single.pk]
    assert not GpuAllocation.objects.filter(task__group=group).exists()
    reason = TaskGroup.objects.get(pk=group.pk).schedule_reason
    assert reason["message"] == "not enough nodes of type nvidia in the tenant's reach: 3 of 4 workers"
    assert reason["workers"] == {"placeable": 3, "needed": 4, "reach": 3} and reason["code"] == "InsufficientResources"
    assert all(t.status == "pending" and t.schedule_reason["group"] == group.pk for t in members(group))
    assert ledger_agrees()


def test_higher_priority_singles_go_first_and_lower_ones_after(world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=8)
    make_node("n1", gpus=8)
    high = make_task(acme, gpu_required=1, priority=90)
    group = make_group(acme, workers=2, gpus=8, priority=50)
    low = make_task(acme, gpu_required=1, priority=10)
    result = run_cycle()
    assert result.groups_bound == [] and sorted(result.bound) == sorted([high.pk, low.pk])
    reason = TaskGroup.objects.get(pk=group.pk).schedule_reason
    assert reason["message"] == "not enough nodes of type nvidia in the tenant's reach: 1 of 2 workers"
    Task.objects.filter(pk__in=[high.pk, low.pk]).update(status="completed")
    GpuAllocation.objects.all().delete()
    assert run_cycle().groups_bound == [group.pk]


def test_a_group_waits_while_an_attempt_is_still_ending(world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=8)
    group = make_group(acme, workers=2, gpus=2)
    Task.objects.filter(group=group, rank=1).update(status="stopping")
    assert run_cycle().groups_bound == []
    Task.objects.filter(group=group, rank=1).update(status="stopped")
    # an ended member of an earlier attempt does not count; a pending one for its rank is missing
    assert run_cycle().groups_bound == []
    assert Task.objects.filter(group=group, status="pending").count() == 1


def group_decision(group, placements):
    """A decision for `group` as the core would make it: (node, cards) per rank."""
    ranks = members(group)
    return GroupDecision(
        group.pk,
        [Decision(t.pk, node, cards, None, 3.0) for t, (node, cards) in zip(ranks, placements, strict=True)],
        6,
    )


def worker_tasks(group):
    return {t.pk: task(id=t.pk, gpus=t.gpu_required, tenant=t.tenant_id, kind="training") for t in members(group)}


def test_a_member_whose_card_was_taken_meanwhile_drops_the_whole_group(world):
    acme = world.tenants["acme"]
    n0, _ = make_node("n0", gpus=2), make_node("n1", gpus=2)
    group = make_group(acme, workers=2, gpus=2)
    make_task_holding(n0, acme, "running", card=1)  # bound by a racer after the snapshot
    decision = group_decision(group, [("n1", [0, 1]), ("n0", [0, 1])])
    bound, lost = bind_all([], worker_tasks(group), SAME_TENANT_ONLY, PluginSettings(), groups=[decision])
    assert bound == [] and sorted(lost) == [t.pk for t in members(group)]
    assert [t.status for t in members(group)] == ["pending", "pending"]
    assert not GpuAllocation.objects.filter(task__group=group).exists()
    assert TaskGroup.objects.get(pk=group.pk).attempts == 0


def test_a_member_moved_meanwhile_rolls_the_group_back_and_keeps_the_singles(world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=4)
    group = make_group(acme, workers=2, gpus=2)
    single = make_task(acme, gpu_required=1)
    ranks = members(group)
    Task.objects.filter(pk=ranks[1].pk).update(status="cancelled")  # the group was being stopped
    tasks = worker_tasks(group) | {single.pk: task(id=single.pk, gpus=1, tenant=acme.pk)}
    decision = group_decision(group, [("n0", [0, 1]), ("n0", [2, 3])])
    bound, lost = bind_all(
        [Decision(single.pk, "n0", [3], None, 1.0)], tasks, SAME_TENANT_ONLY, PluginSettings(), groups=[decision]
    )
    # the single's card 3 is also rank 1's: the core never decides that, but the group
    # losing must leave the single's bind (and only it) in place
    assert bound == [single.pk]
    assert Task.objects.get(pk=ranks[0].pk).status == "pending"
    assert list(GpuAllocation.objects.values_list("task_id", flat=True)) == [single.pk]


def make_inference_group(tenant, workers, gpus):
    group = make_group(tenant, workers=workers, gpus=gpus, kind="inference")
    Task.objects.filter(group=group).update(kind="inference")
    return group


def test_every_member_of_an_inference_group_gets_a_host_port_at_bind(world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=2)
    make_node("n1", gpus=1)
    group = make_inference_group(acme, workers=3, gpus=1)
    assert run_cycle().groups_bound == [group.pk]
    ranks = members(group)
    assert all(t.host_port is not None and 8000 <= t.host_port < 9000 for t in ranks)
    on_node = sorted((t.node_id, t.host_port) for t in ranks)
    assert len(set(on_node)) == 3 and len({port for node, port in on_node if node == "n0"}) == 2
    # a training group: only the master's port (MASTER_PORT)
    make_node("n2", gpus=2)
    training = make_group(acme, workers=2, gpus=1)
    assert run_cycle().groups_bound == [training.pk]
    assert [t.host_port is not None for t in members(training)] == [True, False]


def test_an_inference_group_is_not_bound_when_a_member_gets_no_port(world, monkeypatch):
    monkeypatch.setattr(bind, "INFERENCE_PORTS", range(8000, 8002))  # two ports per node
    acme = world.tenants["acme"]
    make_node("n0", gpus=4)
    group = make_inference_group(acme, workers=3, gpus=1)
    result = run_cycle()  # the snapshot counts the ports: two workers fit on the node, not three
    assert result.groups_bound == []
    assert TaskGroup.objects.get(pk=group.pk).schedule_reason["workers"]["placeable"] == 2
    # bind checks again on the live rows: a decision for three is dropped whole
    decision = group_decision(group, [("n0", [0]), ("n0", [1]), ("n0", [2])])
    tasks = {t.pk: task(id=t.pk, gpus=1, tenant=acme.pk, kind="inference") for t in members(group)}
    bound, lost = bind_all([], tasks, SAME_TENANT_ONLY, PluginSettings(), groups=[decision])
    assert bound == [] and len(lost) == 3
    assert [t.host_port for t in members(group)] == [None, None, None]
    assert not GpuAllocation.objects.filter(task__group=group).exists()
