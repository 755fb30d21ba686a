"""The offline sweep: a node silent for more than 45 s raises NODE_OFFLINE once and its
tasks are handled by state; a node heard from again recovers the alert."""

from datetime import timedelta

import pytest

from apps.alerts.failures import sweep_offline_nodes
from apps.alerts.jobs import sweep_job
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.nodes.models import Node
from apps.scheduler.models import GpuAllocation
from apps.tasks.models import Task
from tests.factories import make_node, make_task_holding
from tests.headers import AGENT

pytestmark = pytest.mark.django_db


def test_a_silent_nodes_tasks_are_handled_by_state(world):
    acme = world.tenants["acme"]
    now = utcnow()
    lost = make_node("lost", gpus=8)
    make_node("alive", gpus=8)

    Node.objects.filter(pk="lost").update(last_heartbeat_at=now - timedelta(seconds=46))
    Node.objects.filter(pk="alive").update(last_heartbeat_at=now)
    statuses = ("running", "scheduled", "starting", "waking", "stopping", "draining", "sleeping", "preempting")
    tasks = {status: make_task_holding(lost, acme, status, card) for card, status in enumerate(statuses)}
    result = sweep_offline_nodes(now=now)
    assert result.offline == ["lost"]
    assert sorted(result.requeued) == sorted(tasks[s].pk for s in ("running", "scheduled", "starting", "waking"))
    after = {status: Task.objects.get(pk=task.pk) for status, task in tasks.items()}
    for status in ("running", "scheduled", "starting", "waking"):
        assert (after[status].status, after[status].node_id) == ("pending", None)
        assert after[status].events.get().kind == "node_lost_pending"
    assert after["stopping"].status == "stopped" and after["draining"].status == "completed"
    assert after["sleeping"].status == "sleeping" and after["preempting"].status == "preempting"
    held = set(GpuAllocation.objects.values_list("task_id", flat=True))
    assert held == {tasks["sleeping"].pk, tasks["preempting"].pk}  # what moved gave its cards back

    # the next sweep moves nothing twice and raises nothing twice
    again = sweep_offline_nodes(now=now + timedelta(seconds=30))
    assert (again.offline, again.requeued, again.finished) == ([], [], [])
    assert Alert.objects.filter(type="NODE_OFFLINE", state="ACTIVE").count() == 1


def test_a_late_report_from_the_lost_node_changes_nothing(api, world):
    acme = world.tenants["acme"]
    now = utcnow()
    lost = make_node("lost", gpus=1)
    make_node("alive", gpus=1)  # somewhere to run it again

    Node.objects.filter(pk="lost").update(last_heartbeat_at=now - timedelta(seconds=50))
    task = make_task_holding(lost, acme, "running")
    sweep_offline_nodes(now=now)
    late = {"node_id": "lost", "from_status": "running", "status": "completed", "exit_code": 0}
    assert api.put(f"/api/v1/tasks/{task.pk}", late, format="json", **AGENT).status_code == 409
    task.refresh_from_db()
    assert task.status == "pending"


def test_with_no_node_alive_the_tasks_fail_instead_of_waiting_forever(world):
    now = utcnow()
    lost = make_node("only", gpus=1)

    Node.objects.filter(pk="only").update(last_heartbeat_at=now - timedelta(seconds=120))
    task = make_task_holding(lost, world.tenants["acme"], "running")
    assert sweep_offline_nodes(now=now).failed == [task.pk]
    task.refresh_from_db()
    assert task.status == "failed" and "no node in the cluster is alive" in task.error_message


def test_a_node_heard_from_again_recovers_its_alert(world):
    now = utcnow()
    make_node("flaky", gpus=1)

    Node.objects.filter(pk="flaky").update(last_heartbeat_at=now - timedelta(seconds=60))
    sweep_offline_nodes(now=now)
    Node.objects.filter(pk="flaky").update(last_heartbeat_at=now + timedelta(seconds=5))
    assert sweep_offline_nodes(now=now + timedelta(seconds=30)).recovered == ["flaky"]
    assert Alert.objects.get(key="node-offline:flaky").state == "RECOVERED"


def test_a_node_silent_for_less_than_45_seconds_is_left_alone(world):
    now = utcnow()
    node = make_node("slow", gpus=1)

    Node.objects.filter(pk="slow").update(last_heartbeat_at=now - timedelta(seconds=44))
    task = make_task_holding(node, world.tenants["acme"], "running")
    assert sweep_offline_nodes(now=now).offline == []
    task.refresh_from_db()
    assert task.status == "running" and not Alert.objects.exists()


def test_the_sweep_job_is_guarded_and_runs(world):
    assert sweep_job() == "ran"
