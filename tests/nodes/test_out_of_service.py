"""Operators take a node out of service: drain (no new task, the ones on it finish) or
maintenance (no new task, its tasks move elsewhere), and return it. The scheduler keeps
off a node carrying the cordon label (and the agents' beats leave that label alone:
test_out_of_service_beats.py)."""

import pytest

from apps.nodes.models import Node
from apps.nodes.services import drain_node, return_to_service, start_maintenance
from apps.scheduler.core import CORDON_LABEL, GpuSnap, NodeSnap, PluginSettings, TaskReq, place
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task
from apps.tasks.services import agent_report, create_task
from tests.factories import make_node

PCIE = {"topology": "pcie"}


def test_the_core_keeps_off_a_cordoned_node():
    cards = [GpuSnap(index=0, vendor="nvidia", memory_total_mb=81920)]
    cordoned = NodeSnap(id="n1", status="online", executable=True, labels={CORDON_LABEL: "drain"}, gpus=cards)
    decisions, failures = place(
        [TaskReq(id=1, tenant_id=1, gpu_required=1)], [cordoned], PluginSettings(), lambda a, b: True
    )
    assert decisions == [] and failures[0].code == "NoSchedulableNodes" and failures[0].removed == {"unavailable": 1}


@pytest.mark.django_db
def test_drain_takes_no_new_task_and_leaves_the_running_ones(world):
    acme = world.tenants["acme"]
    node = make_node("n1", gpus=2, labels=PCIE)
    first = create_task(tenant=acme, name="a", image="x", gpu_required=1)
    assert run_cycle().bound == [first.pk]
    first.refresh_from_db()
    assert agent_report(first, from_status="scheduled", to_status="running")
    drained = drain_node(node)
    assert drained.node.labels == {"topology": "pcie", CORDON_LABEL: "drain"}
    second = create_task(tenant=acme, name="b", image="x", gpu_required=1)
    result = run_cycle()
    assert result.bound == [] and result.failed[second.pk]["code"] == "NoSchedulableNodes"
    assert Task.objects.get(pk=first.pk).status == "running"
    return_to_service(node)
    assert Node.objects.get(pk="n1").labels == {"topology": "pcie"}
    assert run_cycle().bound == [second.pk]


@pytest.mark.django_db
def test_maintenance_moves_the_tasks_elsewhere(world):
    acme = world.tenants["acme"]
    node = make_node("n1", gpus=2, labels=PCIE)
    waiting = create_task(tenant=acme, name="scheduled", image="x", gpu_required=1)
    running = create_task(tenant=acme, name="running", image="x", gpu_required=1)
    assert sorted(run_cycle().bound) == [waiting.pk, running.pk]
    running.refresh_from_db()
    assert agent_report(running, from_status="scheduled", to_status="running")
    make_node("n2", gpus=2, labels=PCIE)
    result = start_maintenance(node)
    assert (result.requeued, result.stopping) == ([waiting.pk], [running.pk])
    waiting.refresh_from_db()
    assert (waiting.status, waiting.node_id) == ("pending", None)
    assert not GpuAllocation.objects.filter(task=waiting).exists()
    assert Task.objects.get(pk=running.pk).status == "preempting"  # the agent stops it first
    assert waiting.events.get().kind == "requeued" and "maintenance" in waiting.events.get().message
    assert run_cycle().bound == [waiting.pk]
    assert Task.objects.get(pk=waiting.pk).node_id == "n2"
    assert agent_report(running, from_status="preempting", to_status="pending")  # the agent's confirmation
    assert run_cycle().bound == [running.pk] and Task.objects.get(pk=running.pk).node_id == "n2"
