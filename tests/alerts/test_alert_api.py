"""The alerts API: who sees what (operators everything; a tenant's people their own task
and tenant alerts; node, GPU and cluster alerts are for operators), filters,
pagination, stats, acknowledge and resolve."""

import pytest

from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.models import Alert
from apps.alerts.services import raise_alert
from tests.factories import make_task
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db


@pytest.fixture
def alerts(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    acme_task, beta_task = make_task(acme, name="a"), make_task(beta, name="b")
    raised = {
        "node": dict(type=AlertType.NODE_OFFLINE, severity=Severity.ERROR, scope=AlertScope.NODE, node_id="n1"),
        "gpu": dict(type=AlertType.GPU_LOST, severity=Severity.ERROR, scope=AlertScope.GPU, node_id="n1", gpu_index=0),
        "cluster": dict(type=AlertType.SCHEDULER_STALLED, severity=Severity.CRITICAL, scope=AlertScope.CLUSTER),
        "acme-task": dict(
            type=AlertType.TASK_FAILED,
            severity=Severity.WARNING,
            scope=AlertScope.TASK,
            task_id=acme_task.pk,
            tenant_id=acme.pk,
            node_id="n1",
        ),
        "acme-quota": dict(
            type=AlertType.QUOTA_EXCEEDED, severity=Severity.WARNING, scope=AlertScope.TENANT, tenant_id=acme.pk
        ),
        "beta-task": dict(
            type=AlertType.TASK_REQUEUED,
            severity=Severity.WARNING,
            scope=AlertScope.TASK,
            task_id=beta_task.pk,
            tenant_id=beta.pk,
            node_id="n1",
        ),
    }
    for name, fields in raised.items():
        assert raise_alert(key=name, message=f"{name} happened", **fields)
    return {name: Alert.objects.get(key=name) for name in raised}


def listed(api, who, world, **params):
    response = api.get("/api/v1/alerts", params, **bearer(world.keys[who] if who != "op" else world.operator_key))
    assert response.status_code == 200, response.content
    return {alert["key"] for alert in response.json()["results"]}


def test_operators_see_every_alert_and_tenants_only_their_own_task_and_tenant_alerts(api, world, alerts):
    assert listed(api, "op", world) == set(alerts)
    for role in ("admin", "member", "viewer"):
        assert listed(api, f"acme-{role}", world) == {"acme-task", "acme-quota"}
    assert listed(api, "beta-member", world) == {"beta-task"}


def test_an_alert_out_of_sight_is_404_never_403(api, world, alerts):
    member = bearer(world.keys["acme-member"])
    for name in ("node", "gpu", "cluster", "beta-task"):
        pk = alerts[name].pk
        assert api.get(f"/api/v1/alerts/{pk}", **member).status_code == 404
        assert api.post(f"/api/v1/alerts/{pk}/acknowledge", **member).status_code == 404
        assert api.post(f"/api/v1/alerts/{pk}/resolve", **bearer(world.keys["acme-admin"])).status_code == 404
    body = api.get(f"/api/v1/alerts/{alerts['acme-task'].pk}", **member).json()
    assert (body["task"], body["tenant"], body["scope"], body["node"]) == (
        alerts["acme-task"].task_id,
        "acme",
        "task",
        "n1",
    )


def test_the_agent_key_and_strangers_get_nothing(api, world, alerts):
    assert api.get("/api/v1/alerts", **AGENT).status_code in (401, 403)
    assert api.get("/api/v1/alerts").status_code in (401, 403)
    assert api.get("/api/v1/alerts/stats").status_code in (401, 403)


def test_filters_and_pagination(api, world, alerts):
    assert listed(api, "op", world, scope="task") == {"acme-task", "beta-task"}
    assert listed(api, "op", world, type="GPU_LOST") == {"gpu"}
    assert listed(api, "op", world, severity="critical") == {"cluster"}
    assert listed(api, "op", world, task_id=alerts["beta-task"].task_id) == {"beta-task"}
    assert listed(api, "op", world, node_id="n1") == {"node", "gpu", "acme-task", "beta-task"}
    assert listed(api, "acme-member", world, node_id="n1") == {"acme-task"}  # still narrowed
    page = api.get("/api/v1/alerts", {"limit": 2, "offset": 2}, **bearer(world.operator_key)).json()
    assert page["count"] == 6 and len(page["results"]) == 2 and page["next"] and page["previous"]
    # newest first
    everything = api.get("/api/v1/alerts", **bearer(world.operator_key)).json()["results"]
    assert [a["id"] for a in everything] == sorted((a["id"] for a in everything), reverse=True)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"state": "OPEN"}, "state"),
        ({"type": "DISK_FULL"}, "type"),
        ({"scope": "galaxy"}, "scope"),
        ({"task_id": "x"}, "task_id"),
        ({"limit": 1000}, "limit"),
        ({"offset": -1}, "offset"),
        ({"colour": "red"}, "colour"),
        ({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "until"),
        ({"since": "yesterday"}, "since"),
    ],
)
def test_a_bad_filter_is_a_400_naming_it(api, world, alerts, params, field):
    response = api.get("/api/v1/alerts", params, **bearer(world.operator_key))
    assert response.status_code == 400 and field in str(response.json())


def test_stats_are_narrowed_to_what_the_caller_sees(api, world, alerts):
    ops = api.get("/api/v1/alerts/stats", **bearer(world.operator_key)).json()
    assert ops["active"] == 6 and ops["active_by_severity"] == {"error": 2, "critical": 1, "warning": 3}
    acme = api.get("/api/v1/alerts/stats", **bearer(world.keys["acme-viewer"])).json()
    assert acme["active"] == 2 and acme["active_by_type"] == {"TASK_FAILED": 1, "QUOTA_EXCEEDED": 1}
    assert acme["by_state"] == {"ACTIVE": 2, "RESOLVED": 0, "RECOVERED": 0} and acme["active_unacknowledged"] == 2


def test_acknowledging_marks_who_and_when_and_only_an_active_alert(api, world, alerts):
    pk = alerts["acme-task"].pk
    response = api.post(f"/api/v1/alerts/{pk}/acknowledge", **bearer(world.keys["acme-viewer"]))
    assert response.status_code == 200
    body = response.json()
    assert body["acknowledged_by"] == "acme-viewer" and body["acknowledged_at"] and body["state"] == "ACTIVE"
    # again: not an error, and the first acknowledgement stands
    again = api.post(f"/api/v1/alerts/{pk}/acknowledge", **bearer(world.keys["acme-admin"])).json()
    assert again["acknowledged_by"] == "acme-viewer"
    assert listed(api, "acme-member", world, acknowledged="true") == {"acme-task"}
    assert listed(api, "acme-member", world, acknowledged="false") == {"acme-quota"}
    api.post(f"/api/v1/alerts/{pk}/resolve", **bearer(world.keys["acme-admin"]))
    assert (
        api.post(f"/api/v1/alerts/{alerts['acme-quota'].pk}/resolve", **bearer(world.operator_key)).status_code == 200
    )
    assert (
        api.post(
            f"/api/v1/alerts/{alerts['acme-quota'].pk}/acknowledge", **bearer(world.keys["acme-member"])
        ).status_code
        == 409
    )


def test_resolving_is_for_operators_and_the_tenants_admins(api, world, alerts):
    pk = alerts["acme-task"].pk
    for who in ("acme-member", "acme-viewer"):
        assert api.post(f"/api/v1/alerts/{pk}/resolve", **bearer(world.keys[who])).status_code == 403
    assert Alert.objects.get(pk=pk).state == "ACTIVE"
    response = api.post(f"/api/v1/alerts/{pk}/resolve", **bearer(world.keys["acme-admin"]))
    assert response.status_code == 200
    assert (response.json()["state"], response.json()["resolved_by"]) == ("RESOLVED", "acme-admin")
    assert response.json()["ended_at"]
    assert api.post(f"/api/v1/alerts/{pk}/resolve", **bearer(world.keys["acme-admin"])).status_code == 409
    node = api.post(f"/api/v1/alerts/{alerts['node'].pk}/resolve", **bearer(world.operator_key))
    assert node.status_code == 200 and node.json()["resolved_by"] == "op"


def test_a_resolved_condition_that_persists_raises_a_new_alert(world, alerts):
    from apps.alerts.services import resolve_alert

    resolve_alert(alerts["node"], world.operator)
    assert raise_alert(
        key="node",
        type=AlertType.NODE_OFFLINE,
        severity=Severity.ERROR,
        scope=AlertScope.NODE,
        node_id="n1",
        message="still silent",
    )
    assert Alert.objects.filter(key="node").count() == 2
    assert not raise_alert(
        key="node",
        type=AlertType.NODE_OFFLINE,
        severity=Severity.ERROR,
        scope=AlertScope.NODE,
        node_id="n1",
        message="still silent",
    )  # one active per key
