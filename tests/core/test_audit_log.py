"""The audit log (docs/security.md#audit-log): every change a person makes is recorded
once, in the tenant's log when it is in one tenant and in the operators' log when an
operator made it; refused requests, reads, agents and dry runs are not changes; operators
read their log with filters, a tenant's admins read their tenant's."""

from __future__ import annotations

import pytest
from django_tenants.utils import schema_context

from apps.confidential.models import AuditEvent
from apps.core.models import OperatorAuditEvent
from tests.factories import make_node, make_task
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db


def tenant_log(tenant) -> list[tuple[str, str, str]]:
    with schema_context(tenant.schema_name):
        return list(AuditEvent.objects.order_by("at", "id").values_list("actor", "action", "target"))


def operator_log() -> list[tuple[str, str, str, str]]:
    return list(OperatorAuditEvent.objects.order_by("at", "id").values_list("actor", "action", "target", "tenant"))


def test_a_task_created_is_recorded_once_by_its_service(api, world):
    acme = world.tenants["acme"]
    before = tenant_log(acme)
    response = api.post(
        "/api/v1/tasks",
        {"name": "t", "image": "x", "gpu_required": 0},
        format="json",
        **bearer(world.keys["acme-member"]),
    )
    assert response.status_code == 201, response.content
    new = tenant_log(acme)[len(before) :]
    assert [(action, target) for _, action, target in new] == [("task.created", str(response.json()["id"]))]
    assert new[0][0].startswith("acme-member (key ")
    assert not operator_log()  # a tenant's person: not the operators' log


def test_a_change_no_service_records_is_recorded_by_its_request(api, world):
    acme = world.tenants["acme"]
    task = make_task(acme, name="to-stop")
    before = tenant_log(acme)
    response = api.post(f"/api/v1/tasks/{task.pk}/stop", **bearer(world.keys["acme-admin"]))
    assert response.status_code == 200, response.content
    (entry,) = tenant_log(acme)[len(before) :]
    assert entry[1:] == ("POST /api/v1/tasks/<int:pk>/stop", f"pk={task.pk}")
    with schema_context(acme.schema_name):
        details = AuditEvent.objects.latest("id").details
    assert details == {"status": 200, "fields": []}
    with schema_context(world.tenants["beta"].schema_name):
        assert not AuditEvent.objects.filter(target=f"pk={task.pk}").exists()


def test_an_operators_change_in_a_tenant_is_in_both_logs(api, world):
    acme = world.tenants["acme"]
    task = make_task(acme, name="op-stops")
    response = api.post(f"/api/v1/tasks/{task.pk}/stop", **bearer(world.operator_key))
    assert response.status_code == 200, response.content
    assert tenant_log(acme)[-1][1:] == ("POST /api/v1/tasks/<int:pk>/stop", f"pk={task.pk}")
    assert operator_log()[-1] == (
        "op (key " + operator_log()[-1][0].split("(key ")[1],
        *tenant_log(acme)[-1][1:],
        "acme",
    )


def test_a_platform_change_is_in_the_operators_log_only(api, world):
    response = api.put("/api/v1/plugins/topology", {"weight": 2.0}, format="json", **bearer(world.operator_key))
    assert response.status_code == 200, response.content
    actor, action, target, tenant = operator_log()[-1]
    assert (action, target, tenant) == ("PUT /api/v1/plugins/<str:name>", "name=topology", "")
    assert OperatorAuditEvent.objects.latest("id").details == {"status": 200, "fields": ["weight"]}
    for tenant in world.tenants.values():
        assert not [entry for entry in tenant_log(tenant) if "plugins" in entry[1]]


def test_refusals_reads_agents_and_dry_runs_are_not_changes(api, world):
    acme = world.tenants["acme"]
    node = make_node("n-audit", 1)
    task = make_task(acme, name="scheduled", status="scheduled", node=node)
    counts = (len(tenant_log(acme)), len(operator_log()))
    # refused: a bad body, a viewer's stop, another tenant's task
    assert api.post("/api/v1/tasks", {"nope": 1}, format="json", **bearer(world.keys["acme-admin"])).status_code == 400
    assert api.post(f"/api/v1/tasks/{task.pk}/stop", **bearer(world.keys["acme-viewer"])).status_code == 403
    assert api.post(f"/api/v1/tasks/{task.pk}/stop", **bearer(world.keys["beta-admin"])).status_code == 404
    # reads, a dry run, the agent's claim
    assert api.get(f"/api/v1/tasks/{task.pk}", **bearer(world.keys["acme-admin"])).status_code == 200
    dry = api.post("/api/v1/scheduler/dry-run", {"gpu_required": 1}, format="json", **bearer(world.keys["acme-admin"]))
    assert dry.status_code == 200, dry.content
    claim = api.put(
        f"/api/v1/tasks/{task.pk}",
        {"node_id": node.pk, "from_status": "scheduled", "status": "running"},
        format="json",
        **AGENT,
    )
    assert claim.status_code == 200, claim.content
    assert (len(tenant_log(acme)), len(operator_log())) == counts


def test_a_portal_form_is_recorded(client, world):
    acme = world.tenants["acme"]
    task = make_task(acme, name="portal-stop")
    client.force_login(world.users["acme-admin"])
    response = client.post(f"/portal/tasks/{task.pk}/stop/")
    assert response.status_code == 302
    actor, action, target = tenant_log(acme)[-1]
    assert (actor, action, target) == ("acme-admin", "POST /portal/tasks/<int:pk>/stop/", f"pk={task.pk}")


def test_operators_read_their_log_with_filters_and_tenants_read_theirs(api, world):
    acme = world.tenants["acme"]
    api.put("/api/v1/plugins/topology", {"weight": 1.5}, format="json", **bearer(world.operator_key))
    api.post(f"/api/v1/tasks/{make_task(acme, name='x').pk}/stop", **bearer(world.operator_key))
    read = api.get("/api/v1/admin/audit", **bearer(world.operator_key))
    assert read.status_code == 200 and read.json()["count"] >= 2
    platform = api.get("/api/v1/admin/audit?tenant=-", **bearer(world.operator_key)).json()["results"]
    assert platform and all(entry["tenant"] == "" for entry in platform)
    of_acme = api.get("/api/v1/admin/audit?tenant=acme&action=stop", **bearer(world.operator_key)).json()["results"]
    assert of_acme and all(entry["tenant"] == "acme" and "stop" in entry["action"] for entry in of_acme)
    assert api.get("/api/v1/admin/audit?since=yesterday", **bearer(world.operator_key)).status_code == 400
    assert api.get("/api/v1/admin/audit", **bearer(world.keys["acme-admin"])).status_code == 403
    # the tenant's admins read their tenant's log: the operator's stop is in it
    log = api.get("/api/v1/tenants/acme/audit", **bearer(world.keys["acme-admin"])).json()["results"]
    assert any(entry["action"] == "POST /api/v1/tasks/<int:pk>/stop" for entry in log)
