"""Preemption end to end against the database: the cycle evicts, the cards stay counted
until the agent confirms (or the watchdog forces it), the preemptor binds next cycle.
Also the host ports of inference tasks."""

from datetime import timedelta

import pytest

from apps.alerts.models import Alert
from apps.scheduler import bind
from apps.scheduler.jobs import preemption_watchdog_job
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import force_overdue_preemptions, run_cycle
from apps.tasks.models import Task
from apps.tasks.services import agent_report, stop_task
from tests.factories import make_node, make_task
from tests.headers import AGENT, bearer
from tests.scheduler.ledger import ledger_agrees

pytestmark = pytest.mark.django_db


def running(task):
    run_cycle()
    task.refresh_from_db()
    assert task.status == "scheduled"
    assert agent_report(task, from_status="scheduled", to_status="running")
    task.refresh_from_db()
    return task


@pytest.fixture
def busy_node(world):
    """n1 with two cards, both held by a low-priority preemptible job that is running."""
    make_node("n1", gpus=2)
    low = running(make_task(world.tenants["acme"], name="low", gpu_required=2, priority=10, preemptible=True))
    return low


def test_a_higher_priority_task_preempts_and_binds_after_the_agent_confirms(api, world, busy_node):
    low = busy_node
    high = make_task(world.tenants["beta"], name="high", gpu_required=2, priority=90)
    result = run_cycle()
    assert result.bound == [] and result.preemptions[high.pk].victims == [low.pk]
    low.refresh_from_db()
    high.refresh_from_db()
    assert low.status == "preempting"
    reason = high.schedule_reason
    assert reason["code"] == "PreemptionPending" and reason["cause"] == "InsufficientResources"
    assert reason["preemption"] == {"node_id": "n1", "victims": [low.pk]}
    # the cards stay counted while the victim stops: nothing else lands on them
    assert GpuAllocation.objects.filter(task=low).count() == 2 and ledger_agrees()
    assert run_cycle().bound == [] and not Task.objects.filter(status="preempting").exclude(pk=low.pk).exists()
    high.refresh_from_db()
    assert high.schedule_reason["preemption"]["victims"] == []  # waiting, nobody new evicted

    # the agent finds the task to stop, stops it and confirms once
    listed = api.get("/api/v1/tasks?node_id=n1&status=preempting", **AGENT).json()["results"]
    assert [t["id"] for t in listed] == [low.pk]
    confirm = {"node_id": "n1", "from_status": "preempting", "status": "pending"}
    assert api.put(f"/api/v1/tasks/{low.pk}", confirm, format="json", **AGENT).status_code == 200
    assert api.put(f"/api/v1/tasks/{low.pk}", confirm, format="json", **AGENT).status_code == 409
    low.refresh_from_db()
    assert (low.status, low.node_id, low.preempt_count, low.preemptible) == ("pending", None, 1, False)
    assert not GpuAllocation.objects.filter(task=low).exists()

    result = run_cycle()
    assert result.bound == [high.pk]
    # the victim is no longer preemptible and outranked: it waits, it evicts nobody
    assert result.failed[low.pk]["code"] == "InsufficientResources" and not result.preemptions
    assert ledger_agrees()


def test_a_task_being_preempted_is_never_marked_completed(api, world, busy_node):
    make_task(world.tenants["acme"], name="high", gpu_required=1, priority=90)
    run_cycle()
    done = {"node_id": "n1", "from_status": "preempting", "status": "completed", "exit_code": 0}
    assert api.put(f"/api/v1/tasks/{busy_node.pk}", done, format="json", **AGENT).status_code == 400
    busy_node.refresh_from_db()
    assert busy_node.status == "preempting"


def test_the_watchdog_forces_an_unconfirmed_preemption_after_60_seconds(api, world, busy_node):
    low = busy_node
    high = make_task(world.tenants["acme"], name="high", gpu_required=2, priority=90)
    run_cycle()
    began = Task.objects.get(pk=low.pk).updated_at
    assert force_overdue_preemptions(now=began + timedelta(seconds=59)) == []
    assert force_overdue_preemptions(now=began + timedelta(seconds=61)) == [low.pk]
    low.refresh_from_db()
    assert (low.status, low.preempt_count, low.preemptible) == ("pending", 1, False)
    alert = Alert.objects.get(type="PREEMPTION_TIMEOUT", state="ACTIVE")
    assert alert.node_id == "n1" and alert.details == {"task_id": low.pk}
    # the agent's late confirmation loses and settles nothing twice
    confirm = {"node_id": "n1", "from_status": "preempting", "status": "pending"}
    assert api.put(f"/api/v1/tasks/{low.pk}", confirm, format="json", **AGENT).status_code == 409
    assert not agent_report(low, from_status="preempting", to_status="pending")
    low.refresh_from_db()
    assert low.preempt_count == 1
    assert run_cycle().bound == [high.pk] and ledger_agrees()


def test_the_watchdog_job_is_guarded_and_runs(world):
    assert preemption_watchdog_job() == "ran"


def test_preemption_disabled_evicts_nobody(api, world, busy_node):
    api.put(
        "/api/v1/plugins/preempt", {"extra": {"preempt_stage": "disabled"}}, format="json", **bearer(world.operator_key)
    )
    high = make_task(world.tenants["acme"], name="high", gpu_required=2, priority=90)
    result = run_cycle()
    assert not result.preemptions and result.failed[high.pk]["code"] == "InsufficientResources"
    busy_node.refresh_from_db()
    assert busy_node.status == "running"


def test_training_waits_its_turn_instead_of_preempting(world, busy_node):
    training = make_task(world.tenants["acme"], name="train", kind="training", gpu_required=2, priority=100)
    result = run_cycle()
    assert not result.preemptions and result.failed[training.pk]["code"] == "InsufficientResources"


# --- host ports for inference -----------------------------------------------------------


def test_inference_tasks_get_distinct_host_ports_and_give_them_back(api, world):
    make_node("n1", gpus=4)
    first = make_task(world.tenants["acme"], name="svc1", kind="inference", gpu_required=1)
    second = make_task(world.tenants["acme"], name="svc2", kind="inference", gpu_required=1)
    job = make_task(world.tenants["acme"], name="job", gpu_required=1)
    run_cycle()
    ports = {t.name: t.host_port for t in Task.objects.all()}
    assert sorted([ports["svc1"], ports["svc2"]]) == [8000, 8001] and ports["job"] is None
    shown = api.get(f"/api/v1/tasks/{first.pk}", **bearer(world.keys["acme-viewer"])).json()
    assert shown["host_port"] == ports["svc1"]
    first.refresh_from_db()
    stop_task(first)  # scheduled → cancelled: its port is free again
    third = make_task(world.tenants["acme"], name="svc3", kind="inference", gpu_required=1)
    run_cycle()
    third.refresh_from_db()
    assert third.host_port == ports["svc1"]
    assert job.pk and second.pk


def test_a_node_with_no_port_left_takes_no_more_inference(world, monkeypatch):
    monkeypatch.setattr(bind, "INFERENCE_PORTS", range(8000, 8001))
    make_node("n1", gpus=4)
    make_task(world.tenants["acme"], name="svc1", kind="inference", gpu_required=1)
    run_cycle()
    late = make_task(world.tenants["acme"], name="svc2", kind="inference", gpu_required=1)
    result = run_cycle()
    assert result.bound == [] and result.failed[late.pk]["removed_by"] == {"ports": 1}  # explained, not a lost race
    late.refresh_from_db()
    assert late.status == "pending" and late.host_port is None
    job = make_task(world.tenants["acme"], name="job", gpu_required=1)
    assert run_cycle().bound == [job.pk]  # other work still lands there
    assert ledger_agrees()
