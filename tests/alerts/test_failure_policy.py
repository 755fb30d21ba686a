"""The rest of the failure policy: the server's verdict on a vanished container, stalled
tasks, the queue time-out, GPU-seconds settled once, and the alerts each raises."""

from datetime import timedelta

import pytest

from apps.alerts.failures import (
    Verdict,
    adjudicate_lost_runs,
    capacity_verdict,
    check_scheduler,
    fail_overdue_queue,
    recover_quota_alerts,
    sweep_offline_nodes,
    sweep_stalled_tasks,
)
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.core.models import JobRun
from apps.nodes.models import Gpu, Node
from apps.scheduler.models import GpuAllocation
from apps.tasks import services
from apps.tasks.models import Task, UsageRecord
from tests.factories import make_node, make_task, make_task_holding
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db


def lost(api, task, node_id="n1", **body):
    return api.post(f"/api/v1/tasks/{task.pk}/container-lost", {"node_id": node_id, **body}, format="json", **AGENT)


# --- the verdict on a vanished container ------------------------------------------------------


def test_a_vanished_container_is_requeued_while_a_node_could_run_it(api, world):
    node = make_node("n1", gpus=2)
    task = make_task_holding(node, world.tenants["acme"], "running")
    response = lost(api, task, detail="docker ps shows nothing")
    assert response.status_code == 200
    assert response.json() == {"task_id": task.pk, "verdict": "requeue", "status": "pending"}
    task.refresh_from_db()
    assert (task.status, task.node_id) == ("pending", None)
    assert not GpuAllocation.objects.filter(task=task).exists()
    assert task.events.get().kind == "container_lost_pending"
    alert = Alert.objects.get(type="TASK_REQUEUED")
    assert (alert.scope, alert.task_id, alert.tenant_id) == ("task", task.pk, world.tenants["acme"].pk)
    # the same report again (a retry): the task has moved on
    assert lost(api, task).status_code == 409


def test_a_vanished_container_fails_when_no_node_could_run_it(api, world):
    node = make_node("n1", gpus=1, executable=False, status="degraded")  # alive, but cannot take work
    make_node("small", gpus=1)  # online, but too small
    task = make_task_holding(node, world.tenants["acme"], "running")
    Task.objects.filter(pk=task.pk).update(gpu_required=2)
    Gpu.objects.create(node=node, index=1, vendor="nvidia")
    response = lost(api, task)
    assert response.status_code == 200 and response.json()["verdict"] == "fail"
    task.refresh_from_db()
    assert task.status == "failed" and "no node that could run it is alive" in task.error_message
    assert Alert.objects.get(type="TASK_FAILED").task_id == task.pk


def test_when_it_cannot_be_told_nothing_changes_and_the_agent_asks_again(api, world):
    node = make_node("n1", gpus=1, status="suspect")  # neither surely alive nor dead
    task = make_task_holding(node, world.tenants["acme"], "running")
    response = lost(api, task)
    assert response.status_code == 202 and response.json()["verdict"] == "undecided"
    task.refresh_from_db()
    assert (task.status, task.node_id) == ("running", "n1")
    assert GpuAllocation.objects.filter(task=task).exists()
    assert task.events.get().kind == "container_lost_undecided"


def test_a_database_error_is_undecided_never_a_failure(world, monkeypatch):
    from apps.alerts import failures

    monkeypatch.setattr(failures, "CAPACITY_SQL", "SELECT no_such_column FROM nodes")
    assert capacity_verdict(gpus=1) == Verdict.UNDECIDED
    assert Node.objects.count() >= 0  # and the transaction is still usable


def test_only_the_agent_of_the_tasks_node_may_report_it_lost(api, world):
    node = make_node("n1", gpus=1)
    make_node("n2", gpus=1)
    task = make_task_holding(node, world.tenants["acme"], "running")
    assert lost(api, task, node_id="n2").status_code == 404  # not on that node: not its business
    people = api.post(
        f"/api/v1/tasks/{task.pk}/container-lost", {"node_id": "n1"}, format="json", **bearer(world.keys["acme-admin"])
    )
    assert people.status_code == 403
    # a field it does not know is ignored (a newer agent, docs/nodes.md), a bad known one is not
    assert lost(api, task, detail="x" * 2001, extra="x").status_code == 400
    assert api.post(f"/api/v1/tasks/{task.pk}/container-lost", {}, format="json", **AGENT).status_code == 400
    task.refresh_from_db()
    assert task.status == "running"


def test_a_task_no_longer_running_there_is_a_conflict(api, world):
    node = make_node("n1", gpus=1)
    task = make_task_holding(node, world.tenants["acme"], "stopping")
    assert lost(api, task).status_code == 409


# --- stalled tasks -----------------------------------------------------------------------


def beat(node_id, live, at):
    Node.objects.filter(pk=node_id).update(live_task_ids=live, last_heartbeat_at=at)


def test_a_running_task_its_live_node_stops_listing_is_requeued_after_60_s(world):
    now = utcnow()
    node = make_node("n1", gpus=2)
    listed, missing = (
        make_task_holding(node, world.tenants["acme"], "running", 0),
        make_task_holding(node, world.tenants["acme"], "running", 1),
    )
    Task.objects.filter(pk__in=[listed.pk, missing.pk]).update(updated_at=now - timedelta(seconds=5))
    beat("n1", [listed.pk], now)
    assert sweep_stalled_tasks(now) == []  # the clock starts
    missing.refresh_from_db()
    assert missing.missing_since == now
    beat("n1", [listed.pk], now + timedelta(seconds=55))
    assert sweep_stalled_tasks(now + timedelta(seconds=55)) == []
    beat("n1", [listed.pk], now + timedelta(seconds=61))
    (outcome,) = sweep_stalled_tasks(now + timedelta(seconds=61))
    assert (outcome.task_id, outcome.verdict, outcome.moved) == (missing.pk, Verdict.REQUEUE, True)
    missing.refresh_from_db()
    listed.refresh_from_db()
    assert (missing.status, missing.missing_since) == ("pending", None)
    assert missing.events.get().kind == "stalled_pending"
    assert listed.status == "running" and listed.missing_since is None


def test_a_task_listed_again_stops_the_clock(world):
    now = utcnow()
    node = make_node("n1", gpus=1)
    task = make_task_holding(node, world.tenants["acme"], "running")
    Task.objects.filter(pk=task.pk).update(updated_at=now - timedelta(seconds=5))
    beat("n1", [], now)
    sweep_stalled_tasks(now)
    beat("n1", [task.pk], now + timedelta(seconds=30))
    sweep_stalled_tasks(now + timedelta(seconds=30))
    task.refresh_from_db()
    assert task.missing_since is None
    beat("n1", [task.pk], now + timedelta(seconds=90))
    assert sweep_stalled_tasks(now + timedelta(seconds=90)) == []


def test_a_node_that_does_not_say_what_is_alive_never_stalls_its_tasks(world):
    now = utcnow()
    node = make_node("n1", gpus=1)
    task = make_task_holding(node, world.tenants["acme"], "running")
    Task.objects.filter(pk=task.pk).update(updated_at=now - timedelta(seconds=5))
    for seconds in (0, 61, 200):
        beat("n1", None, now + timedelta(seconds=seconds))
        assert sweep_stalled_tasks(now + timedelta(seconds=seconds)) == []
    task.refresh_from_db()
    assert task.missing_since is None and task.status == "running"


def test_a_beat_sent_before_the_claim_does_not_count(world):
    now = utcnow()
    node = make_node("n1", gpus=1)
    task = make_task_holding(node, world.tenants["acme"], "running")
    Task.objects.filter(pk=task.pk).update(updated_at=now)
    beat("n1", [], now - timedelta(seconds=2))  # sent before the task was claimed
    sweep_stalled_tasks(now)
    task.refresh_from_db()
    assert task.missing_since is None


# --- the queue time-out --------------------------------------------------------------------


def test_the_queue_deadline_runs_from_the_later_of_creation_and_last_change(world, settings):
    settings.HETEROFLOW_QUEUE_TIMEOUT_SECONDS = 3600
    now = utcnow()
    acme = world.tenants["acme"]
    stale = make_task(acme, name="stale")
    requeued = make_task(acme, name="requeued service")
    # created two days ago; `requeued` ran all that time and came back to the queue a minute ago
    Task.objects.filter(pk=stale.pk).update(created_at=now - timedelta(days=2), updated_at=now - timedelta(days=2))
    Task.objects.filter(pk=requeued.pk).update(
        created_at=now - timedelta(days=2), updated_at=now - timedelta(minutes=1)
    )
    assert fail_overdue_queue(now) == [stale.pk]
    stale.refresh_from_db()
    requeued.refresh_from_db()
    assert stale.status == "failed" and "more than 3600 s" in stale.error_message
    assert requeued.status == "pending"
    assert Alert.objects.get(type="TASK_FAILED").task_id == stale.pk


def test_a_queue_timeout_of_zero_waits_forever(world, settings):
    settings.HETEROFLOW_QUEUE_TIMEOUT_SECONDS = 0
    task = make_task(world.tenants["acme"])
    Task.objects.filter(pk=task.pk).update(
        created_at=utcnow() - timedelta(days=30), updated_at=utcnow() - timedelta(days=30)
    )
    assert fail_overdue_queue() == []


# --- GPU-seconds -----------------------------------------------------------------------------


def test_gpu_seconds_count_every_run_and_are_settled_once_when_the_task_ends(world):
    node = make_node("n1", gpus=2)
    task = make_task_holding(node, world.tenants["acme"], "scheduled")
    Task.objects.filter(pk=task.pk).update(gpu_required=2)
    t0 = utcnow()
    assert services.move_tasks(task.pk, ["scheduled"], "running", running_since=t0 - timedelta(seconds=100))
    # its node was lost after 100 s: the run counts, and the task goes back to the queue
    assert services.move_tasks(task.pk, ["running"], "pending", node=None)
    task.refresh_from_db()
    assert task.gpu_seconds == pytest.approx(2 * 100, abs=1) and task.running_since is None
    assert not UsageRecord.objects.filter(task=task).exists()  # not ended yet: nothing settled
    # the second run: 50 s, then it completes
    Task.objects.filter(pk=task.pk).update(status="scheduled", node=node)
    services.move_tasks(task.pk, ["scheduled"], "running", running_since=utcnow() - timedelta(seconds=50))
    assert services.agent_report(task, from_status="running", to_status="completed", exit_code=0)
    record = UsageRecord.objects.get(task=task)
    assert record.gpu_seconds == pytest.approx(2 * 150, abs=2) and record.gpus == 2
    assert (record.ended_status, record.tenant_id) == ("completed", world.tenants["acme"].pk)
    # settled once: a second settlement (however it came) changes nothing
    services._settle_usage([task.pk], utcnow())
    assert UsageRecord.objects.filter(task=task).count() == 1


def test_ending_in_place_on_a_lost_node_settles_usage_too(world):
    now = utcnow()
    node = make_node("lost", gpus=1)
    make_node("alive", gpus=1)
    task = make_task_holding(node, world.tenants["acme"], "stopping")
    Task.objects.filter(pk=task.pk).update(running_since=now - timedelta(seconds=300))
    Node.objects.filter(pk="lost").update(last_heartbeat_at=now - timedelta(seconds=50))
    assert sweep_offline_nodes(now=now).finished == [task.pk]
    assert UsageRecord.objects.get(task=task).gpu_seconds == pytest.approx(300, abs=1)


def test_a_cancelled_queued_task_settles_zero(world):
    task = make_task(world.tenants["acme"])
    services.stop_task(task)
    assert UsageRecord.objects.get(task=task).gpu_seconds == 0


def test_the_stats_sum_what_was_settled(api, world):
    task = make_task(world.tenants["acme"])
    services.stop_task(task)
    Task.objects.filter(pk=task.pk).update(gpu_seconds=42.0)
    UsageRecord.objects.filter(task=task).update(gpu_seconds=42.0)
    stats = api.get("/api/v1/tasks/stats", **bearer(world.keys["acme-member"])).json()
    assert stats["gpu_seconds_settled"] == 42.0
    assert api.get("/api/v1/tasks/stats", **bearer(world.keys["beta-member"])).json()["gpu_seconds_settled"] == 0


# --- quota and scheduler alerts ------------------------------------------------------------------


def test_a_refused_task_raises_quota_exceeded_once_and_it_recovers(api, world):
    acme = world.tenants["acme"]
    acme.max_concurrent_tasks = 1
    acme.save()
    first = make_task(acme)
    body = {"name": "more", "image": "x", "gpu_required": 1}
    for _ in range(2):
        response = api.post("/api/v1/tasks", body, format="json", **bearer(world.keys["acme-member"]))
        assert response.status_code == 409
    alert = Alert.objects.get(type="QUOTA_EXCEEDED")
    assert (alert.state, alert.scope, alert.tenant_id) == ("ACTIVE", "tenant", acme.pk)
    assert recover_quota_alerts() == []  # still full
    services.stop_task(first)
    assert recover_quota_alerts() == [acme.pk]
    alert.refresh_from_db()
    assert alert.state == "RECOVERED"


def test_scheduler_stalled_while_tasks_wait_and_recovered_after_a_cycle(world, settings):
    now = utcnow()
    task = make_task(world.tenants["acme"])
    Task.objects.filter(pk=task.pk).update(created_at=now - timedelta(minutes=5))
    JobRun.objects.update_or_create(key="scheduler.tick", defaults={"last_finished_at": now - timedelta(minutes=3)})
    assert check_scheduler(now) is True
    assert check_scheduler(now) is True  # raised once
    alert = Alert.objects.get(type="SCHEDULER_STALLED")
    assert (alert.state, alert.scope, alert.severity) == ("ACTIVE", "cluster", "critical")
    JobRun.objects.filter(key="scheduler.tick").update(last_finished_at=now)
    assert check_scheduler(now) is False
    alert.refresh_from_db()
    assert alert.state == "RECOVERED"


def test_an_idle_scheduler_with_nothing_waiting_is_not_stalled(world):
    JobRun.objects.filter(key="scheduler.tick").delete()
    assert check_scheduler() is False
    assert not Alert.objects.filter(type="SCHEDULER_STALLED").exists()


def test_adjudication_answers_every_task_asked_about(world):
    node = make_node("n1", gpus=1)
    running = make_task_holding(node, world.tenants["acme"], "running")
    outcomes = adjudicate_lost_runs([running.pk, 999_999], node_id="n1", cause="container_lost")
    assert [(o.task_id, o.verdict, o.moved) for o in outcomes] == [
        (running.pk, Verdict.REQUEUE, True),
        (999_999, Verdict.UNDECIDED, False),
    ]
