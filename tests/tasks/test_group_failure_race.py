"""Two workers of one group lost at the same moment, in two transactions on two
connections: the attempt ends once, the group is requeued once, and no report errors or
deadlocks (every move to pending or failed locks the group before its members)."""

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Count

from apps.alerts.failures import sweep_offline_nodes
from apps.core.clock import utcnow
from apps.nodes.models import Node
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task, TaskEvent, TaskGroup
from apps.tasks.services import agent_report
from apps.tenants import services
from tests.factories import make_group, make_node

pytestmark = pytest.mark.django_db(transaction=True)


def at_once(*works) -> list:
    """Each work() in its own thread on its own connection, released together; the
    results (or the exceptions raised) in the works' order."""
    barrier = threading.Barrier(len(works))
    results: list = [None] * len(works)

    def run(i):
        try:
            barrier.wait(10)
            results[i] = works[i]()
        except Exception as exc:  # noqa: BLE001 — the test asserts there is none
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(works))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


@pytest.fixture
def tenant():
    tenant = services.create_tenant(name="Group Race", slug="group-race")
    yield tenant
    Task.objects.filter(tenant=tenant).delete()
    Node.objects.all().delete()
    services.delete_tenant(tenant)


def running_group(tenant) -> list[Task]:
    group = make_group(tenant, workers=4, gpus=4)
    assert run_cycle().groups_bound == [group.pk]
    ranks = list(Task.objects.filter(group=group).order_by("rank"))
    for task in ranks:
        assert agent_report(task, from_status="scheduled", to_status="running")
    return ranks


def report_failed(task):
    return lambda: agent_report(task, from_status="running", to_status="failed", exit_code=1)


def requeued_once(group_id) -> bool:
    per_task = dict(
        TaskEvent.objects.filter(task__group_id=group_id, kind="group_requeued")
        .values_list("task")
        .annotate(n=Count("id"))
    )
    return sorted(per_task.values()) == [1, 1, 1, 1]


@pytest.mark.parametrize("round", range(4))
def test_two_members_failing_at_once_requeue_the_group_once(tenant, round):
    make_node("n0", gpus=8)
    make_node("n1", gpus=8)
    ranks = running_group(tenant)
    group_id = ranks[0].group_id
    outcomes = at_once(report_failed(ranks[0]), report_failed(ranks[2]))
    # one report ended the attempt; the other member was already being stopped for the
    # requeue, and its run's end confirmed that stop
    assert outcomes == [True, True]
    for task in ranks:
        task.refresh_from_db()
        if task.status == "preempting":
            assert agent_report(task, from_status="preempting", to_status="pending")
    assert list(Task.objects.filter(group_id=group_id).values_list("status", flat=True)) == ["pending"] * 4
    assert TaskEvent.objects.filter(task__group_id=group_id, kind="worker_failed_pending").count() == 1
    assert requeued_once(group_id)
    group = TaskGroup.objects.get(pk=group_id)
    assert (group.attempts, group.ended_attempt) == (1, 1)
    assert run_cycle().groups_bound == [group_id]
    assert TaskGroup.objects.get(pk=group_id).attempts == 2


def test_a_node_sweep_and_a_failure_report_at_once_requeue_the_group_once(tenant):
    make_node("n0", gpus=8)
    make_node("n1", gpus=8)
    ranks = running_group(tenant)
    group_id = ranks[0].group_id
    Node.objects.filter(pk="n1").update(last_heartbeat_at=utcnow() - timedelta(seconds=120))
    outcomes = at_once(sweep_offline_nodes, report_failed(ranks[0]))
    assert not any(isinstance(outcome, Exception) for outcome in outcomes), outcomes
    for task in Task.objects.filter(group_id=group_id, status="preempting"):
        assert agent_report(task, from_status="preempting", to_status="pending")
    assert list(Task.objects.filter(group_id=group_id).values_list("status", flat=True)) == ["pending"] * 4
    assert requeued_once(group_id)
    assert TaskGroup.objects.get(pk=group_id).ended_attempt == 1
