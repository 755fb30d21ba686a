"""Requeue (the operators' admin action): not started, straight back to the queue; started,
stopped by the agent first like a preemption; anything else is refused or left alone."""

import pytest

from apps.core.errors import Conflict
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.tasks.services import agent_report, create_task, requeue_task, stop_task
from tests.factories import make_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def node(world):
    return make_node("n1", gpus=2, model="")


def test_a_scheduled_task_goes_straight_back_to_the_queue(world, node):
    task = create_task(tenant=world.tenants["acme"], name="t", image="x", gpu_required=2)
    run_cycle()
    task = requeue_task(task)
    assert (task.status, task.node_id, task.host_port) == ("pending", None, None)
    assert not GpuAllocation.objects.filter(task=task).exists()
    assert [e.kind for e in task.events.all()] == ["requeued"]
    assert run_cycle().bound == [task.pk]


def test_a_running_task_is_stopped_first_then_queued(world, node):
    task = create_task(tenant=world.tenants["acme"], name="t", image="x", gpu_required=1)
    run_cycle()
    task.refresh_from_db()
    agent_report(task, from_status="scheduled", to_status="running")
    task = requeue_task(task)
    assert task.status == "preempting" and GpuAllocation.objects.filter(task=task).exists()  # cards held until stopped
    assert agent_report(task, from_status="preempting", to_status="pending")
    task.refresh_from_db()
    assert (task.status, task.node_id) == ("pending", None)


def test_pending_stays_and_ended_tasks_are_refused(world, node):
    task = create_task(tenant=world.tenants["acme"], name="t", image="x", gpu_required=8)  # fits nowhere
    assert requeue_task(task).status == "pending" and not task.events.exists()
    stop_task(task)
    with pytest.raises(Conflict, match="is cancelled: only scheduled, starting and running tasks can be requeued"):
        requeue_task(task)
