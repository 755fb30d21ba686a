"""Drain, maintenance and return to service through the API (POST
/api/v1/admin/nodes/{id}/drain, /maintenance, /return): operators only, strict bodies,
404 for an unknown node, 409 when the move does not apply, the node's state in the
answer, through the same services as the admin's actions, and audited."""

import pytest
from django_tenants.utils import schema_context

from apps.confidential.models import AuditEvent
from apps.core.models import OperatorAuditEvent
from apps.nodes.choices import CORDON_LABEL
from apps.nodes.models import Node
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task
from apps.tasks.services import agent_report, create_task
from tests.factories import make_node
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db
PCIE = {"topology": "pcie"}


def url(node_id, move):
    return f"/api/v1/admin/nodes/{node_id}/{move}"


def post(api, world, node_id, move, body=None, key=None):
    return api.post(url(node_id, move), body or {}, format="json", **bearer(key or world.operator_key))


def test_drain_then_return_answers_the_nodes_state(api, world):
    make_node("n1", gpus=2, labels=PCIE)
    drained = post(api, world, "n1", "drain")
    assert drained.status_code == 200, drained.content
    body = drained.json()
    assert (body["service"], body["requeued"], body["stopping"]) == ("drain", [], [])
    assert body["node"]["id"] == "n1" and body["node"]["labels"] == {**PCIE, CORDON_LABEL: "drain"}
    assert Node.objects.get(pk="n1").labels[CORDON_LABEL] == "drain"
    back = post(api, world, "n1", "return")
    assert back.status_code == 200
    assert back.json()["service"] == "in_service" and back.json()["node"]["labels"] == PCIE
    assert Node.objects.get(pk="n1").labels == PCIE


def test_maintenance_moves_the_tasks_and_names_them(api, world):
    acme = world.tenants["acme"]
    make_node("n1", gpus=2, labels=PCIE)
    waiting = create_task(tenant=acme, name="scheduled", image="x", gpu_required=1)
    running = create_task(tenant=acme, name="running", image="x", gpu_required=1)
    assert sorted(run_cycle().bound) == [waiting.pk, running.pk]
    running.refresh_from_db()
    assert agent_report(running, from_status="scheduled", to_status="running")
    response = post(api, world, "n1", "maintenance", {"reason": "PSU swap"})
    assert response.status_code == 200
    body = response.json()
    assert (body["service"], body["requeued"], body["stopping"]) == ("maintenance", [waiting.pk], [running.pk])
    assert Task.objects.get(pk=waiting.pk).status == "pending"
    assert Task.objects.get(pk=running.pk).status == "preempting"  # the agent stops it first
    assert run_cycle().bound == []  # the node takes no new task


@pytest.mark.parametrize(
    "before,move,code",
    [
        ("", "return", "in service"),
        ("drain", "drain", "drain"),
        ("maintenance", "drain", "maintenance"),
        ("maintenance", "maintenance", "maintenance"),
    ],
)
def test_a_move_that_does_not_apply_is_409_and_changes_nothing(api, world, before, move, code):
    labels = {**PCIE, CORDON_LABEL: before} if before else dict(PCIE)
    make_node("n1", gpus=1, labels=labels)
    response = post(api, world, "n1", move)
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "service_move_not_applicable" and code in error["message"]
    assert Node.objects.get(pk="n1").labels == labels


def test_a_drain_can_be_hardened_into_maintenance(api, world):
    make_node("n1", gpus=1, labels=PCIE)
    assert post(api, world, "n1", "drain").status_code == 200
    assert post(api, world, "n1", "maintenance").json()["service"] == "maintenance"
    assert post(api, world, "n1", "return").json()["service"] == "in_service"


def test_only_operators_may_and_an_unknown_node_is_404(api, world):
    make_node("n1", gpus=1)
    assert post(api, world, "nobody", "drain").status_code == 404
    assert post(api, world, "nobody", "return").status_code == 404
    for who in ("acme-admin", "acme-member", "acme-viewer"):
        assert post(api, world, "n1", "drain", key=world.keys[who]).status_code == 403
    assert api.post(url("n1", "drain"), {}, format="json", **AGENT).status_code == 403
    assert api.post(url("n1", "drain"), {}, format="json").status_code == 401
    assert CORDON_LABEL not in Node.objects.get(pk="n1").labels


def test_the_body_is_strict(api, world):
    make_node("n1", gpus=1)
    unknown = post(api, world, "n1", "drain", {"force": True})
    assert unknown.status_code == 400 and "force" in unknown.json()["error"]["fields"]
    too_long = post(api, world, "n1", "maintenance", {"reason": "x" * 501})
    assert too_long.status_code == 400 and "reason" in too_long.json()["error"]["fields"]
    assert CORDON_LABEL not in Node.objects.get(pk="n1").labels
    assert api.get(url("n1", "drain"), **bearer(world.operator_key)).status_code == 405


def test_a_dedicated_nodes_moves_go_into_its_tenants_audit_log(api, world):
    acme = world.tenants["acme"]
    make_node("n1", gpus=1, tenant=acme)
    assert post(api, world, "n1", "drain", {"reason": "rack move"}).status_code == 200
    assert post(api, world, "n1", "return").status_code == 200
    with schema_context(acme.schema_name):
        events = list(AuditEvent.objects.filter(target="n1").order_by("at", "id"))
    assert [(e.action, e.details["from"], e.details["to"]) for e in events] == [
        ("node.drain", "in_service", "drain"),
        ("node.return", "drain", "in_service"),
    ]
    assert events[0].details["reason"] == "rack move" and events[0].actor.startswith("op")
    # the tenant's admins read it in their audit log
    log = api.get("/api/v1/tenants/acme/audit", **bearer(world.keys["acme-admin"])).json()["results"]
    assert {"node.drain", "node.return"} <= {entry["action"] for entry in log}
    with schema_context(world.tenants["beta"].schema_name):
        assert not AuditEvent.objects.filter(target="n1").exists()


def test_a_shared_nodes_moves_go_into_the_operators_audit_log(api, world):
    make_node("n1", gpus=1)
    assert post(api, world, "n1", "drain", {"reason": "fans"}).status_code == 200
    (event,) = OperatorAuditEvent.objects.filter(target="n1")
    assert (event.action, event.tenant, event.details["to"]) == ("node.drain", "", "drain")
    assert event.details["reason"] == "fans"
    assert event.actor.startswith("op")
    for tenant in world.tenants.values():
        with schema_context(tenant.schema_name):
            assert not AuditEvent.objects.filter(target="n1").exists()  # no tenant's business
