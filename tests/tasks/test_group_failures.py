"""Failures as a group: a lost worker (its run failed, its node given up, its container
lost) ends the attempt of the whole group, once; the group is requeued whole, or failed
whole (its last attempt, a member failed for good or already completed, nothing alive
to run it); a group stopped on purpose stays stopped; a late report from an ended
attempt is refused."""

from datetime import timedelta

import pytest
from django.db.models import Count
from django.test import override_settings

from apps.alerts.failures import adjudicate_lost_runs, fail_overdue_queue, sweep_offline_nodes, sweep_requeued_groups
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.nodes.models import Node
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task, TaskEvent, TaskGroup
from apps.tasks.services import agent_report, stop_tasks
from tests.factories import make_group, make_node
from tests.headers import AGENT

pytestmark = pytest.mark.django_db


def members(group) -> list[Task]:
    return list(Task.objects.filter(group=group).order_by("rank"))


def statuses(group) -> list[str]:
    return [task.status for task in members(group)]


def running_group(tenant, workers=4, gpus=4, **fields) -> TaskGroup:
    """A group bound by the scheduler (two per node on n0 and n1) and started by its agents."""
    group = make_group(tenant, workers=workers, gpus=gpus, **fields)
    assert run_cycle().groups_bound == [group.pk]
    for task in members(group):
        assert agent_report(task, from_status="scheduled", to_status="running")
    group.refresh_from_db()
    return group


def confirm_stops(group) -> None:
    """The agents stop the members asked to stop (preempting for a requeue, stopping)."""
    for task in members(group):
        if task.status == "preempting":
            assert agent_report(task, from_status="preempting", to_status="pending")
        elif task.status == "stopping":
            assert agent_report(task, from_status="stopping", to_status="stopped", exit_code=143)


def kinds(task) -> list[str]:
    return list(TaskEvent.objects.filter(task=task).order_by("id").values_list("kind", flat=True))


@pytest.fixture
def nodes(world):
    return [make_node("n0", gpus=8), make_node("n1", gpus=8)]


def test_a_failed_worker_requeues_the_whole_group_once_and_it_is_placed_again(world, nodes):
    group = running_group(world.tenants["acme"])
    worker = members(group)[3]
    assert agent_report(worker, from_status="running", to_status="failed", exit_code=1, error_message="NCCL timeout")
    worker.refresh_from_db()
    # the failed run goes back to the queue (off its node, cards released); the others are
    # stopped by their agents first
    assert (worker.status, worker.node_id, worker.exit_code) == ("pending", None, None)
    assert statuses(group) == ["preempting", "preempting", "preempting", "pending"]
    assert not GpuAllocation.objects.filter(task=worker).exists()
    event = TaskEvent.objects.get(task=worker, kind="worker_failed_pending")
    assert event.details == {"exit_code": 1, "error_message": "NCCL timeout", "attempt": 1}
    assert "NCCL timeout" in event.message and "attempt 1" in event.message
    alert = Alert.objects.get(type="TASK_REQUEUED", task=worker)
    assert alert.details["group_id"] == group.pk
    assert run_cycle().groups_bound == []  # not whole yet: three members still on their nodes

    confirm_stops(group)
    assert statuses(group) == ["pending"] * 4
    assert not GpuAllocation.objects.filter(task__group=group).exists()
    for task in members(group):
        requeued = TaskEvent.objects.get(task=task, kind="group_requeued")
        assert requeued.message == (
            "attempt 1: rank 3 on node n1 was lost: the attempt ended and the group is requeued whole "
            "(attempt 2 of at most 3 once it is placed)"
        )
    group.refresh_from_db()
    assert (group.attempts, group.ended_attempt, group.status) == (1, 1, "pending")

    assert run_cycle().groups_bound == [group.pk]
    group.refresh_from_db()
    assert (group.attempts, group.ended_attempt, group.status) == (2, 1, "scheduled")
    assert TaskEvent.objects.filter(task__group=group, kind="group_requeued").count() == 4  # once per member


def test_a_given_up_node_requeues_the_whole_group(world, nodes):
    group = running_group(world.tenants["acme"])
    Node.objects.filter(pk="n1").update(last_heartbeat_at=utcnow() - timedelta(seconds=120))
    result = sweep_offline_nodes()
    lost = [t.pk for t in members(group) if t.rank >= 2]
    assert sorted(result.requeued) == lost
    assert statuses(group) == ["preempting", "preempting", "pending", "pending"]
    assert all("node_lost_pending" in kinds(task) for task in members(group)[2:])
    confirm_stops(group)
    assert statuses(group) == ["pending"] * 4
    assert sweep_offline_nodes().requeued == []  # a second sweep moves nothing
    assert TaskEvent.objects.filter(task__group=group, kind="group_requeued").count() == 4
    make_node("n2", gpus=8)
    assert run_cycle().groups_bound == [group.pk]
    assert {t.node_id for t in members(group)} == {"n0", "n2"}


def test_a_lost_container_requeues_the_whole_group(world, nodes):
    group = running_group(world.tenants["acme"])
    rank0 = members(group)[0]
    (outcome,) = adjudicate_lost_runs([rank0.pk], node_id="n0", cause="container_lost")
    assert outcome.moved and outcome.verdict == "requeue"
    assert statuses(group) == ["pending", "preempting", "preempting", "preempting"]
    requeued = TaskEvent.objects.get(task=rank0, kind="group_requeued")
    assert "rank 0 on node n0 was lost" in requeued.message


def test_two_workers_failing_at_once_end_the_attempt_once(world, nodes):
    """One report ends the attempt; the other member is already being stopped for the
    requeue, so its run's end confirms that stop. One requeue, one attempt more."""
    group = running_group(world.tenants["acme"])
    first, second = members(group)[0], members(group)[2]
    assert agent_report(first, from_status="running", to_status="failed", exit_code=1)
    assert agent_report(second, from_status="running", to_status="failed", exit_code=1)
    second.refresh_from_db()
    assert second.status == "pending"
    assert "worker_failed_pending" not in kinds(second)  # its end confirmed the stop
    confirm_stops(group)
    assert statuses(group) == ["pending"] * 4
    per_task = dict(
        TaskEvent.objects.filter(task__group=group, kind="group_requeued").values_list("task").annotate(n=Count("id"))
    )
    assert per_task == {task.pk: 1 for task in members(group)}
    group.refresh_from_db()
    assert (group.attempts, group.ended_attempt) == (1, 1)
    assert run_cycle().groups_bound == [group.pk]
    group.refresh_from_db()
    assert group.attempts == 2


@override_settings(HETEROFLOW_GROUP_MAX_ATTEMPTS=2)
def test_the_last_attempt_lost_fails_the_group_whole_with_the_reason(world, nodes):
    group = running_group(world.tenants["acme"])
    agent_report(members(group)[1], from_status="running", to_status="failed", exit_code=1)
    confirm_stops(group)
    assert run_cycle().groups_bound == [group.pk]
    for task in members(group):
        agent_report(task, from_status="scheduled", to_status="running")
    # attempt 2 of 2: a lost worker now fails the group whole
    worker = members(group)[1]
    assert agent_report(worker, from_status="running", to_status="failed", exit_code=137)
    worker.refresh_from_db()
    assert worker.status == "failed"
    assert worker.exit_code == 137  # its own report, kept
    assert statuses(group) == ["stopping", "failed", "stopping", "stopping"]
    for task in members(group):
        assert TaskEvent.objects.get(task=task, kind="group_failed").message == (
            f"task group {group.name} failed: attempt 2: rank 1 on node n0 failed, "
            "the last attempt allowed (HETEROFLOW_GROUP_MAX_ATTEMPTS = 2)"
        )
    confirm_stops(group)
    assert statuses(group) == ["stopped", "failed", "stopped", "stopped"]
    group.refresh_from_db()
    assert group.status == "failed"
    assert run_cycle().groups_bound == []
    assert not GpuAllocation.objects.filter(task__group=group).exists()


@override_settings(HETEROFLOW_GROUP_MAX_ATTEMPTS=1)
def test_a_node_lost_in_the_last_attempt_fails_the_group_whole(world, nodes):
    group = running_group(world.tenants["acme"])
    Node.objects.filter(pk="n1").update(last_heartbeat_at=utcnow() - timedelta(seconds=120))
    sweep_offline_nodes()
    lost = members(group)[2]
    assert statuses(group) == ["stopping", "stopping", "failed", "failed"]
    assert lost.error_message == (
        f"task group {group.name} failed: attempt 1: rank 2 on node n1, rank 3 on node n1 was lost, "
        "the last attempt allowed (HETEROFLOW_GROUP_MAX_ATTEMPTS = 1)"
    )
    assert Alert.objects.filter(type="TASK_FAILED", task=lost).exists()
    confirm_stops(group)
    assert TaskGroup.objects.get(pk=group.pk).status == "failed"


def test_a_member_that_completes_is_not_a_failure(world, nodes):
    group = running_group(world.tenants["acme"])
    first = members(group)[0]
    assert agent_report(first, from_status="running", to_status="completed", exit_code=0)
    assert statuses(group) == ["completed", "running", "running", "running"]
    assert TaskGroup.objects.get(pk=group.pk).status == "running"
    for task in members(group)[1:]:
        assert agent_report(task, from_status="running", to_status="completed", exit_code=0)
    assert TaskGroup.objects.get(pk=group.pk).status == "completed"
    assert not TaskEvent.objects.filter(task__group=group, kind__startswith="group_").exists()


def test_a_loss_after_a_member_completed_fails_the_group(world, nodes):
    group = running_group(world.tenants["acme"])
    agent_report(members(group)[0], from_status="running", to_status="completed", exit_code=0)
    worker = members(group)[2]
    assert agent_report(worker, from_status="running", to_status="failed", exit_code=1)
    assert statuses(group) == ["completed", "stopping", "failed", "stopping"]
    event = TaskEvent.objects.get(task=members(group)[1], kind="group_failed")
    assert "a group runs again only whole" in event.message


def test_a_group_stopped_on_purpose_ends_stopped_and_is_never_requeued(world, nodes):
    group = running_group(world.tenants["acme"])
    stop_tasks([task.pk for task in members(group)[:3]])  # rank 3's stop is not through yet
    # rank 3's container vanishes meanwhile: it is lost, and cancelled, not requeued
    (outcome,) = adjudicate_lost_runs([members(group)[3].pk], node_id="n1", cause="container_lost")
    assert outcome.moved
    assert statuses(group) == ["stopping", "stopping", "stopping", "cancelled"]
    # one agent's stopped process ends with a failure code by itself: its stop is confirmed
    assert agent_report(members(group)[0], from_status="running", to_status="failed", exit_code=143)
    confirm_stops(group)
    assert statuses(group) == ["stopped"] * 3 + ["cancelled"]
    assert TaskGroup.objects.get(pk=group.pk).status == "stopped"
    assert run_cycle().groups_bound == []
    assert not TaskEvent.objects.filter(task__group=group, kind="group_requeued").exists()


def test_a_requeued_group_fails_whole_when_nothing_alive_can_run_a_worker(world, nodes):
    group = running_group(world.tenants["acme"])
    agent_report(members(group)[0], from_status="running", to_status="failed", exit_code=1)
    confirm_stops(group)
    assert sweep_requeued_groups() == []  # both nodes alive: it waits for the scheduler
    Node.objects.update(last_heartbeat_at=utcnow() - timedelta(seconds=120))
    assert sweep_requeued_groups() == [group.pk]
    assert statuses(group) == ["failed"] * 4
    assert members(group)[0].error_message == (
        f"task group {group.name} failed: requeued after attempt 1, and no live node could run one of its "
        "workers (4 nvidia cards)"
    )
    assert sweep_requeued_groups() == []


def test_a_member_failing_in_the_queue_fails_the_group(world, nodes):
    group = make_group(world.tenants["acme"], workers=3, gpus=16)  # fits nowhere: waits
    run_cycle()
    Task.objects.filter(group=group, rank=1).update(created_at=utcnow() - timedelta(days=2))
    Task.objects.filter(group=group, rank=1).update(updated_at=utcnow() - timedelta(days=2))
    assert fail_overdue_queue() == [members(group)[1].pk]
    assert statuses(group) == ["failed"] * 3
    assert TaskGroup.objects.get(pk=group.pk).status == "failed"


def test_a_late_report_from_an_ended_attempt_is_refused(world, nodes, api):
    group = running_group(world.tenants["acme"])
    old = members(group)[3]
    agent_report(members(group)[0], from_status="running", to_status="failed", exit_code=1)
    # rank 3's agent on n1 is slow: the member is preempting, and its agent confirms
    confirm_stops(group)
    done = {"node_id": "n1", "from_status": "running", "status": "completed", "exit_code": 0}
    late = api.put(f"/api/v1/tasks/{old.pk}", done, format="json", **AGENT)
    assert late.status_code == 409 and late.json()["error"]["code"] == "attempt_ended"
    assert "back in the queue with its group" in late.json()["error"]["message"]
    assert Task.objects.get(pk=old.pk).status == "pending"
    # placed again: rank 3 is on another node now; the old node's report still changes nothing
    Node.objects.filter(pk="n1").update(last_heartbeat_at=utcnow() - timedelta(seconds=120))
    make_node("n2", gpus=8)
    assert run_cycle().groups_bound == [group.pk]
    old.refresh_from_db()
    assert old.node_id != "n1"
    for body in (done, done | {"status": "failed", "exit_code": 1}, done | {"from_status": "scheduled"}):
        late = api.put(f"/api/v1/tasks/{old.pk}", body, format="json", **AGENT)
        assert late.status_code == 409 and late.json()["error"]["code"] == "attempt_ended", late.json()
        assert f"on node {old.node_id} now" in late.json()["error"]["message"]
    assert statuses(group) == ["scheduled"] * 4
    # a task outside a group keeps its answer: not on that node, not found
    single = Task.objects.create(tenant=world.tenants["acme"], name="single", node=nodes[0], status="running")
    assert api.put(f"/api/v1/tasks/{single.pk}", done, format="json", **AGENT).status_code == 404


def test_a_report_naming_an_ended_attempt_never_moves_the_next_one_on_the_same_node(world, api):
    make_node("n0", gpus=8)  # one node: the group is placed again where it was
    group = running_group(world.tenants["acme"], workers=2, gpus=4)
    rank1 = members(group)[1]
    hand_out = api.get("/api/v1/tasks", {"node_id": "n0", "status": "running"}, **AGENT).json()["results"]
    assert {task["attempt"] for task in hand_out} == {1}
    agent_report(members(group)[0], from_status="running", to_status="failed", exit_code=1)
    confirm_stops(group)
    assert run_cycle().groups_bound == [group.pk]
    scheduled = api.get("/api/v1/tasks", {"node_id": "n0", "status": "scheduled"}, **AGENT).json()["results"]
    assert {task["attempt"] for task in scheduled} == {2}
    for task in members(group):
        agent_report(task, from_status="scheduled", to_status="running")
    # attempt 1's outcome for rank 1, retried late, from the same node: refused
    late = {"node_id": "n0", "from_status": "running", "status": "failed", "exit_code": 1, "attempt": 1}
    answer = api.put(f"/api/v1/tasks/{rank1.pk}", late, format="json", **AGENT)
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "attempt_ended"
    assert "is in attempt 2 now: this report is about attempt 1" in answer.json()["error"]["message"]
    assert statuses(group) == ["running", "running"]
    # the current attempt's own report goes through
    done = late | {"status": "completed", "exit_code": 0, "attempt": 2}
    assert api.put(f"/api/v1/tasks/{rank1.pk}", done, format="json", **AGENT).json()["status"] == "completed"


def test_one_member_stopped_stops_the_group_with_it(world, nodes):
    group = running_group(world.tenants["acme"])
    rank1 = members(group)[1]
    stop_tasks([rank1.pk])  # a person stops one worker (or an eviction does)
    assert statuses(group) == ["running", "stopping", "running", "running"]
    assert agent_report(rank1, from_status="stopping", to_status="stopped", exit_code=143)
    assert statuses(group) == ["stopping", "stopped", "stopping", "stopping"]
    event = TaskEvent.objects.get(task=members(group)[0], kind="group_stopped")
    assert event.message == "rank 1 on node n0 was stopped: the group stops with it"
    confirm_stops(group)
    assert statuses(group) == ["stopped"] * 4
    assert TaskGroup.objects.get(pk=group.pk).status == "stopped"
    assert run_cycle().groups_bound == []
