"""A node's deletion runs the pre-checks other apps register with apps.nodes.services
(the registry keeps the nodes layer from importing the ones above it): a check that
refuses makes the delete a 409 with nothing written, what an earlier check cleared
included; the inference app registers its own (the models registered on the node)."""

import pytest

from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.inference import services as inference_services
from apps.nodes import services as node_services
from apps.nodes.models import Gpu, Node, NodeMetric
from apps.tasks.choices import TaskStatus
from apps.tasks.models import Task
from tests.factories import TaskFactory, make_node

pytestmark = pytest.mark.django_db


def refuse(node, *, force, principal):
    raise Conflict(f"Node '{node.pk}' is held by a test.", "node_held")


def rename(node, *, force, principal):
    Node.objects.filter(pk=node.pk).update(name="renamed by an earlier check")
    return {"renamed": True}


def written(node_id: str):
    return (
        list(Node.objects.filter(pk=node_id).values_list("name", flat=True)),
        Gpu.objects.filter(node_id=node_id).count(),
        list(Task.objects.filter(node_id=node_id).values_list("pk", flat=True)),
        NodeMetric.objects.filter(node_id=node_id).count(),
    )


def test_a_registered_check_that_refuses_leaves_everything_as_it_was(world, monkeypatch):
    node = make_node("held-1", 2)
    TaskFactory(tenant=world.tenants["acme"], node=node, status=TaskStatus.COMPLETED, finished_at=utcnow())
    NodeMetric.objects.create(node_id="held-1", at=utcnow(), cpu_used=12.5)
    before = written("held-1")
    monkeypatch.setattr(node_services, "DELETION_CHECKS", [*node_services.DELETION_CHECKS, rename, refuse])
    with pytest.raises(Conflict) as refused:
        node_services.delete_node(node, force=True)
    assert refused.value.get_codes() == "node_held"
    assert written("held-1") == before  # the earlier check's write is undone with the rest


def test_what_the_checks_clear_is_in_the_answer(world, monkeypatch):
    node = make_node("gone-1", 1)
    monkeypatch.setattr(node_services, "DELETION_CHECKS", [*node_services.DELETION_CHECKS, rename])
    deleted = node_services.delete_node(node)
    assert deleted.node_id == "gone-1" and deleted.cleared["renamed"] is True
    assert deleted.cleared["deleted_models"] == [] and not Node.objects.filter(pk="gone-1").exists()


def test_the_active_tasks_come_first_and_no_check_runs_then(world, monkeypatch):
    node = make_node("busy-1", 1)
    TaskFactory(tenant=world.tenants["acme"], node=node, status=TaskStatus.RUNNING)
    monkeypatch.setattr(node_services, "DELETION_CHECKS", [refuse])
    with pytest.raises(Conflict) as refused:
        node_services.delete_node(node, force=True)
    assert refused.value.get_codes() == "node_has_active_tasks"


def test_the_inference_app_registers_its_check_once():
    assert node_services.DELETION_CHECKS.count(inference_services.clear_models_on) == 1
    node_services.register_deletion_check(inference_services.clear_models_on)
    assert node_services.DELETION_CHECKS.count(inference_services.clear_models_on) == 1
