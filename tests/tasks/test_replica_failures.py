"""Failures of an inference service's replicas (members of a group placed as `replicas`):
each is a single task. A replica that dies, or whose node or container is lost, ends (or
goes back to the queue) alone: the group's attempt is not ended, its siblings keep
serving, and no group event is written; the service's rebuild job takes it from there.
Gang groups keep their rules (tests/tasks/test_group_failures.py)."""

from datetime import timedelta

import pytest
from django.test import override_settings

from apps.alerts.failures import adjudicate_lost_runs, fail_overdue_queue, sweep_offline_nodes, sweep_requeued_groups
from apps.core.clock import utcnow
from apps.nodes.models import Node
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task, TaskEvent, TaskGroup
from apps.tasks.services import agent_report, lock_groups_of, requeue_replicas, stop_tasks
from tests.factories import make_node, make_replica_group
from tests.headers import AGENT

pytestmark = pytest.mark.django_db

SERVING = {"engine": "llama.cpp", "model": "tiny", "format": "gguf", "source": "/models/tiny.gguf", "args": []}
GROUP_EVENTS = ("group_requeued", "group_failed", "group_stopped")


def members(group) -> list[Task]:
    return list(Task.objects.filter(group=group).order_by("rank"))


def statuses(group) -> list[str]:
    return [task.status for task in members(group)]


def group_events(group) -> int:
    return TaskEvent.objects.filter(task__group=group, kind__in=GROUP_EVENTS).count()


@pytest.fixture
def nodes(world):
    return [make_node("n0", gpus=8), make_node("n1", gpus=8)]


def serving_service(tenant, replicas=2) -> TaskGroup:
    """A service whose replicas the scheduler placed (one per node, by the spread) and
    whose agents started them."""
    group = make_replica_group(tenant, replicas=replicas, serving=SERVING)
    run_cycle()
    for task in members(group):
        assert agent_report(task, from_status="scheduled", to_status="running")
    assert sorted(t.node_id for t in members(group)) == ["n0", "n1"][:replicas]
    return group


def unchanged(group) -> None:
    """The group's attempt bookkeeping untouched, and no group event written."""
    group = TaskGroup.objects.get(pk=group.pk)
    assert (group.attempts, group.ended_attempt) == (0, 0)
    assert group_events(group) == 0


def test_a_replica_whose_node_dies_is_requeued_alone_and_its_sibling_keeps_serving(world, nodes):
    service = serving_service(world.tenants["acme"])
    lost, sibling = sorted(members(service), key=lambda t: t.node_id != "n1")
    Node.objects.filter(pk="n1").update(last_heartbeat_at=utcnow() - timedelta(seconds=120))
    result = sweep_offline_nodes()
    assert result.requeued == [lost.pk]
    lost.refresh_from_db()
    sibling.refresh_from_db()
    assert (lost.status, lost.node_id, lost.host_port) == ("pending", None, None)
    assert not GpuAllocation.objects.filter(task=lost).exists()
    assert (sibling.status, sibling.node_id) == ("running", "n0") and sibling.host_port is not None
    assert GpuAllocation.objects.filter(task=sibling).exists()
    assert TaskGroup.objects.with_status().get(pk=service.pk).status == "running"
    unchanged(service)
    # placed again by the single tasks' path, on the node that is alive, next to its sibling
    assert run_cycle().bound == [lost.pk]
    lost.refresh_from_db()
    assert (lost.status, lost.node_id) == ("scheduled", "n0") and lost.host_port != sibling.host_port


def test_a_replica_whose_run_fails_just_fails(world, nodes):
    service = serving_service(world.tenants["acme"])
    dead, sibling = members(service)
    assert agent_report(dead, from_status="running", to_status="failed", exit_code=137, error_message="OOM")
    dead.refresh_from_db()
    # not sent back to the queue with the group (a gang member would be): it ends, and the
    # service's rebuild requeues it
    assert (dead.status, dead.exit_code, dead.error_message) == ("failed", 137, "OOM")
    assert statuses(service) == ["failed", "running"]
    assert TaskGroup.objects.with_status().get(pk=service.pk).status == "running"
    assert "worker_failed_pending" not in TaskEvent.objects.filter(task=dead).values_list("kind", flat=True)
    unchanged(service)


def test_a_replica_whose_container_vanished_is_requeued_alone(world, nodes):
    service = serving_service(world.tenants["acme"])
    first, second = members(service)
    (outcome,) = adjudicate_lost_runs([first.pk], node_id=first.node_id, cause="container_lost")
    assert outcome.moved and outcome.verdict == "requeue"
    assert statuses(service) == ["pending", "running"]
    unchanged(service)


def test_a_replica_stopped_by_a_scale_down_does_not_stop_the_others(world, nodes):
    service = serving_service(world.tenants["acme"])
    first, second = members(service)
    assert stop_tasks([second.pk]) == [second.pk]
    assert agent_report(second, from_status="stopping", to_status="stopped", exit_code=143)
    assert statuses(service) == ["running", "stopped"]
    assert TaskGroup.objects.with_status().get(pk=service.pk).status == "running"
    unchanged(service)


def test_a_replica_failing_in_the_queue_fails_alone(world, nodes):
    service = make_replica_group(world.tenants["acme"], replicas=2, gpus=16)  # no node has 16 cards
    run_cycle()
    first, second = members(service)
    Task.objects.filter(pk=first.pk).update(
        updated_at=utcnow() - timedelta(days=2), created_at=utcnow() - timedelta(days=2)
    )
    with override_settings(HETEROFLOW_QUEUE_TIMEOUT_SECONDS=3600):
        assert fail_overdue_queue() == [first.pk]
    assert statuses(service) == ["failed", "pending"]
    unchanged(service)


def test_a_replicas_group_is_never_failed_whole_by_the_requeued_groups_sweep(world):
    service = make_replica_group(world.tenants["acme"], replicas=2, gpus=4)  # no node alive at all
    TaskGroup.objects.filter(pk=service.pk).update(attempts=1, ended_attempt=1)  # as a gang requeued whole
    assert sweep_requeued_groups() == []
    assert statuses(service) == ["pending", "pending"]


def test_moving_replicas_locks_no_group(world, nodes):
    service = make_replica_group(world.tenants["acme"], replicas=2)
    assert lock_groups_of([t.pk for t in members(service)]) == []


def test_the_hand_out_carries_serving_and_no_attempt_or_rank_wiring(world, nodes, api):
    service = serving_service(world.tenants["acme"])
    node_id = members(service)[0].node_id
    (handed,) = api.get("/api/v1/tasks", {"node_id": node_id, "status": "running"}, **AGENT).json()["results"]
    assert handed["serving"] == SERVING
    assert "attempt" not in handed
    assert not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"} & set(handed["env"])
    assert handed["host_port"] is not None and handed["kind"] == "inference"
    single = api.get(f"/api/v1/tasks/{handed['id']}", {"node_id": node_id}, **AGENT).json()
    assert single["serving"] == SERVING and "attempt" not in single


def test_reports_about_a_replica_answer_as_for_a_single_task(world, nodes, api):
    service = serving_service(world.tenants["acme"])
    first, _ = members(service)
    elsewhere = "n1" if first.node_id == "n0" else "n0"
    done = {"node_id": elsewhere, "from_status": "running", "status": "completed", "exit_code": 0}
    # from a node it is not on: not found (a gang member would get 409 attempt_ended)
    assert api.put(f"/api/v1/tasks/{first.pk}", done, format="json", **AGENT).status_code == 404
    # an attempt number echoed by an older hand-out changes nothing for a replica
    here = done | {"node_id": first.node_id, "status": "failed", "exit_code": 1, "attempt": 3}
    answer = api.put(f"/api/v1/tasks/{first.pk}", here, format="json", **AGENT)
    assert answer.status_code == 200 and answer.json()["status"] == "failed"
    # the same report again lost its compare-and-set: 409 status_changed, not attempt_ended
    again = api.put(f"/api/v1/tasks/{first.pk}", here, format="json", **AGENT)
    assert again.status_code == 409 and again.json()["error"]["code"] == "status_changed"
    assert statuses(service) == ["failed", "running"]
    unchanged(service)


def test_a_failed_replica_requeued_by_the_rebuild_is_placed_again_away_from_its_sibling(world, nodes):
    service = serving_service(world.tenants["acme"])
    dead, sibling = members(service)
    assert agent_report(dead, from_status="running", to_status="failed", exit_code=1)
    assert requeue_replicas([dead.pk], why="rebuild: the replica died") == [dead.pk]
    assert run_cycle().bound == [dead.pk]
    dead.refresh_from_db()
    sibling.refresh_from_db()
    assert dead.status == "scheduled" and dead.node_id != sibling.node_id and dead.host_port is not None
    assert statuses(service) == ["scheduled", "running"]
    unchanged(service)
