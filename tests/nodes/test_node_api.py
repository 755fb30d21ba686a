from datetime import timedelta

import pytest
from django.db import connection

from apps.core.clock import utcnow
from apps.inference.models import Model
from apps.nodes.models import Gpu, Node
from apps.tasks.choices import ACTIVE, TaskStatus
from tests.factories import TaskFactory
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(world):
    now = utcnow()
    shared = Node.objects.create(
        id="shared-1", name="alpha", ip="198.51.100.1", rack="r12", zone="az1", gpu_model="H100", last_heartbeat_at=now
    )
    Gpu.objects.create(node=shared, index=0, vendor="nvidia", model="NVIDIA H100")
    Gpu.objects.create(
        node=shared, index=1, vendor="nvidia", model="NVIDIA H100", lost_at=now, lost_basis="heartbeat_absent"
    )
    acme_node = Node.objects.create(id="acme-1", name="bravo", tenant=world.tenants["acme"], status="offline")
    Gpu.objects.create(node=acme_node, index=0, vendor="ascend", model="Ascend 910B")
    beta_node = Node.objects.create(id="beta-1", name="charlie", tenant=world.tenants["beta"])
    return {"shared": shared, "acme": acme_node, "beta": beta_node}


def ids(response):
    return [n["id"] for n in response.json()["results"]]


def test_operators_see_all_nodes_tenants_see_shared_and_their_own(api, world, fleet):
    assert ids(api.get("/api/v1/nodes", **bearer(world.operator_key))) == ["shared-1", "acme-1", "beta-1"]
    assert ids(api.get("/api/v1/nodes", **bearer(world.keys["acme-viewer"]))) == ["shared-1", "acme-1"]
    assert api.get("/api/v1/nodes/beta-1", **bearer(world.keys["acme-admin"])).status_code == 404
    assert api.get("/api/v1/nodes/acme-1", **bearer(world.keys["acme-viewer"])).status_code == 200
    assert api.get("/api/v1/nodes", **AGENT).status_code == 403
    assert api.get("/api/v1/nodes").status_code == 401


@pytest.mark.parametrize(
    "params,expected",
    [
        ("q=alp", ["shared-1"]),
        ("q=198.51.100", ["shared-1"]),
        ("q=r12", ["shared-1"]),
        ("q=910B", ["acme-1"]),
        ("q=beta-1", ["beta-1"]),
        ("status=offline", ["acme-1"]),
        ("gpu_type=ascend", ["acme-1"]),
        ("limit=1&offset=1", ["acme-1"]),
    ],
)
def test_list_filters_and_pages_in_the_database(api, world, fleet, params, expected):
    response = api.get(f"/api/v1/nodes?{params}", **bearer(world.operator_key))
    assert response.status_code == 200
    assert ids(response) == expected


def test_a_page_says_how_many_match_and_links_its_neighbours(api, world, fleet):
    page = api.get("/api/v1/nodes?limit=1&offset=1", **bearer(world.operator_key)).json()
    assert page["count"] == 3 and [n["id"] for n in page["results"]] == ["acme-1"]
    assert "offset=2" in page["next"] and "limit=1" in page["next"] and page["previous"].endswith("limit=1")
    filtered = api.get("/api/v1/nodes?status=offline&limit=5", **bearer(world.operator_key)).json()
    assert (filtered["count"], filtered["next"], filtered["previous"]) == (1, None, None)
    beyond = api.get("/api/v1/nodes?offset=10", **bearer(world.keys["acme-viewer"])).json()
    assert (beyond["count"], beyond["results"]) == (2, [])


def test_list_rejects_bad_parameters(api, world, fleet):
    for params in ("status=sleepy", "limit=0", "limit=100000", "offset=-1", "gpu_type=quantum", "colour=red"):
        response = api.get(f"/api/v1/nodes?{params}", **bearer(world.operator_key))
        assert response.status_code == 400, params


def test_detail_counts_lost_gpus_and_gpu_used_from_active_tasks(api, world, fleet):
    TaskFactory(tenant=world.tenants["acme"], node=fleet["shared"], status=TaskStatus.RUNNING, gpu_required=4)
    TaskFactory(tenant=world.tenants["acme"], node=fleet["shared"], status=TaskStatus.COMPLETED, gpu_required=8)
    node = api.get("/api/v1/nodes/shared-1", **bearer(world.operator_key)).json()
    assert node["gpu_used"] == 4 and node["gpus_lost"] == 1
    assert [g["state"] for g in node["gpus"]] == ["available", "lost"]


@pytest.mark.parametrize(
    "who,node,expected",
    [
        ("operator", "shared-1", 200),
        ("operator", "acme-1", 200),
        ("acme-admin", "acme-1", 200),
        ("acme-admin", "shared-1", 403),
        ("acme-member", "acme-1", 403),
        ("acme-viewer", "acme-1", 403),
        ("acme-admin", "beta-1", 404),
        ("agent", "shared-1", 403),
    ],
)
def test_delete_permissions(api, world, fleet, who, node, expected):
    headers = AGENT if who == "agent" else bearer(world.operator_key if who == "operator" else world.keys[who])
    response = api.delete(f"/api/v1/nodes/{node}", **headers)
    assert response.status_code == expected, response.content
    assert Node.objects.filter(pk=node).exists() == (expected != 200)


@pytest.mark.parametrize("status", [s for s in ACTIVE if s != TaskStatus.PENDING])
def test_delete_is_refused_while_tasks_are_active_even_with_force(api, world, fleet, status):
    task = TaskFactory(tenant=world.tenants["acme"], node=fleet["shared"], status=status)
    response = api.delete("/api/v1/nodes/shared-1?force=true", **bearer(world.operator_key))
    assert response.status_code == 409
    assert f"#{task.pk} ({status})" in response.json()["error"]["message"]
    assert Node.objects.filter(pk="shared-1").exists()


def test_delete_cascades_to_gpus_and_keeps_finished_tasks(api, world, fleet):
    done = TaskFactory(tenant=world.tenants["acme"], node=fleet["shared"], status=TaskStatus.COMPLETED)
    response = api.delete("/api/v1/nodes/shared-1", **bearer(world.operator_key))
    assert response.status_code == 200 and response.json() == {
        "deleted": "shared-1",
        "deleted_models": [],
        "unregistered_models": [],
        "other_tenants_models": 0,
    }
    assert not Gpu.objects.filter(node_id="shared-1").exists()
    done.refresh_from_db()
    assert done.node_id is None


def register(tenant, name, *nodes) -> Model:
    model = Model.objects.create(tenant=tenant, name=name, source_kind="hub", source="org/m", format="gguf")
    model.nodes.set(nodes)
    return model


def test_delete_is_refused_while_models_are_registered_on_the_node_naming_them(api, world, fleet):
    register(world.tenants["acme"], "only-here", fleet["shared"])
    register(world.tenants["beta"], "also-beta", fleet["shared"], fleet["beta"])
    response = api.delete("/api/v1/nodes/shared-1", **bearer(world.operator_key))
    assert response.status_code == 409 and response.json()["error"]["code"] == "node_has_models"
    message = response.json()["error"]["message"]
    assert "acme/only-here" in message and "beta/also-beta" in message and "force" in message
    assert Node.objects.filter(pk="shared-1").exists() and Model.objects.count() == 2
    assert fleet["shared"].registered_models.count() == 2


def test_force_deletes_the_models_registered_only_there_and_unregisters_the_others(api, world, fleet):
    register(world.tenants["acme"], "only-here", fleet["shared"])
    stays = register(world.tenants["beta"], "also-beta", fleet["shared"], fleet["beta"])
    elsewhere = register(world.tenants["acme"], "elsewhere", fleet["acme"])
    response = api.delete("/api/v1/nodes/shared-1?force=true", **bearer(world.operator_key))
    assert response.status_code == 200, response.content
    assert response.json() == {
        "deleted": "shared-1",
        "deleted_models": ["acme/only-here"],
        "unregistered_models": ["beta/also-beta"],
        "other_tenants_models": 0,
    }
    assert not Node.objects.filter(pk="shared-1").exists()
    assert sorted(Model.objects.values_list("name", flat=True)) == ["also-beta", "elsewhere"]
    assert list(stays.nodes.values_list("pk", flat=True)) == ["beta-1"]
    assert list(elsewhere.nodes.values_list("pk", flat=True)) == ["acme-1"]


def test_force_never_overrides_active_tasks_and_then_removes_no_registration(api, world, fleet):
    register(world.tenants["acme"], "only-here", fleet["shared"])
    TaskFactory(tenant=world.tenants["acme"], node=fleet["shared"], status=TaskStatus.RUNNING)
    response = api.delete("/api/v1/nodes/shared-1?force=true", **bearer(world.operator_key))
    assert response.status_code == 409 and response.json()["error"]["code"] == "node_has_active_tasks"
    assert Model.objects.filter(name="only-here", nodes="shared-1").exists()


def test_a_tenant_admin_is_told_of_other_tenants_models_without_their_names(api, world, fleet):
    register(world.tenants["acme"], "ours", fleet["acme"])
    register(world.tenants["beta"], "theirs", fleet["acme"])  # pinned while the node was shared, say
    key = bearer(world.keys["acme-admin"])
    refused = api.delete("/api/v1/nodes/acme-1", **key)
    assert refused.status_code == 409
    message = refused.json()["error"]["message"]
    assert "acme/ours" in message and "1 of other tenants" in message and "theirs" not in message
    forced = api.delete("/api/v1/nodes/acme-1?force=yes", **key).json()
    assert forced["deleted_models"] == ["acme/ours"] and forced["other_tenants_models"] == 1
    assert not Model.objects.exists()


def test_manual_create_is_for_agents_and_operators_only(api, world):
    body = {"id": "manual-1", "name": "spare", "ip": "192.0.2.10", "cpu_cores": 64}
    assert api.post("/api/v1/nodes", body, format="json", **bearer(world.keys["acme-admin"])).status_code == 403
    created = api.post("/api/v1/nodes", body, format="json", **bearer(world.operator_key))
    assert created.status_code == 201 and created.json()["name"] == "spare"
    again = api.post("/api/v1/nodes", {"id": "manual-1", "cpu_cores": 96}, format="json", **AGENT)
    assert again.status_code == 200 and again.json()["cpu_cores"] == 96 and again.json()["name"] == "spare"
    assert (
        api.post(
            "/api/v1/nodes", {"id": "manual-2", "status": "online"}, format="json", **bearer(world.operator_key)
        ).status_code
        == 400
    )


def test_location_semantics(api, world, fleet):
    url, headers = "/api/v1/admin/nodes/shared-1/location", bearer(world.operator_key)
    assert api.put(url, {"region": "cn-north"}, format="json", **headers).json()["zone"] == "az1"  # omitted: unchanged
    node = api.put(url, {"zone": "", "rack": " r7 "}, format="json", **headers).json()
    assert (node["region"], node["zone"], node["rack"]) == ("cn-north", "", "r7")  # empty string clears
    assert api.put(url, {"rack": "x" * 65}, format="json", **headers).status_code == 400
    assert api.put(url, {"floor": "2"}, format="json", **headers).status_code == 400
    assert api.put(url, {"rack": "r1"}, format="json", **bearer(world.keys["acme-admin"])).status_code == 403


def test_tenant_assignment_with_optimistic_concurrency_drain_and_evict(api, world, fleet):
    url, headers = "/api/v1/admin/nodes/shared-1/tenant", bearer(world.operator_key)
    beta_task = TaskFactory(tenant=world.tenants["beta"], node=fleet["shared"], status=TaskStatus.RUNNING)
    acme_task = TaskFactory(tenant=world.tenants["acme"], node=fleet["shared"], status=TaskStatus.RUNNING)
    drained = api.put(url, {"tenant": "acme", "version": 1}, format="json", **headers).json()
    assert drained["node"]["tenant"] == "acme" and drained["node"]["version"] == 2
    assert drained["other_tenant_tasks"] == [beta_task.pk] and drained["stopping"] == []
    stale = api.put(url, {"tenant": None, "version": 1}, format="json", **headers)
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_version"
    evicted = api.put(url, {"tenant": "acme", "version": 2, "mode": "evict"}, format="json", **headers).json()
    assert evicted["stopping"] == [beta_task.pk]
    beta_task.refresh_from_db()
    acme_task.refresh_from_db()
    assert (beta_task.status, acme_task.status) == ("stopping", "running")
    # now dedicated: beta no longer sees it
    assert api.get("/api/v1/nodes/shared-1", **bearer(world.keys["beta-admin"])).status_code == 404
    assert api.put(url, {"tenant": "nope", "version": 3}, format="json", **headers).status_code == 400


def insert_metrics(node_id, samples):
    with connection.cursor() as cursor:
        for at, cpu, gpus in samples:
            cursor.execute(
                "INSERT INTO node_metrics (node_id, at, cpu_used, memory_used, gpus) "
                "VALUES (%s, %s, %s, %s, %s::jsonb)",
                [node_id, at, cpu, 50.0, gpus],
            )


def test_metrics_history_is_bucketed_and_bounded(api, world, fleet):
    now = utcnow()
    insert_metrics(
        "shared-1",
        [(now - timedelta(seconds=5 * i), 10.0 + i % 3, '[{"i": 0, "u": 50, "p": 300}]') for i in range(720)],
    )
    one_hour = api.get("/api/v1/nodes/metrics/shared-1?hours=1", **bearer(world.operator_key)).json()
    assert one_hour["bucket_seconds"] == 10 and 350 <= len(one_hour["points"]) <= 400
    week = api.get("/api/v1/nodes/metrics/shared-1?hours=168", **bearer(world.operator_key)).json()
    assert week["bucket_seconds"] == 1800 and len(week["points"]) <= 400
    point = one_hour["points"][-1]
    assert point["gpus"][0]["utilization"] == 50 and point["gpus"][0]["temperature"] is None
    assert api.get("/api/v1/nodes/metrics/shared-1?hours=169", **bearer(world.operator_key)).status_code == 400
    assert api.get("/api/v1/nodes/metrics/beta-1?hours=1", **bearer(world.keys["acme-admin"])).status_code == 404


def test_energy_is_null_without_data_and_integrated_with_it(api, world, fleet):
    empty = api.get("/api/v1/nodes/acme-1/energy?hours=24", **bearer(world.operator_key)).json()
    assert empty["gpu_energy_kwh"] is None and empty["samples_with_power"] == 0
    now = utcnow()
    insert_metrics(
        "shared-1",
        [(now - timedelta(seconds=5 * i), 1.0, '[{"i": 0, "p": 400}, {"i": 1, "p": 200}]') for i in range(13)],
    )
    energy = api.get("/api/v1/nodes/shared-1/energy?hours=1", **bearer(world.operator_key)).json()
    assert energy["gpu_power_avg_w"] == 600
    assert energy["gpu_energy_kwh"] == pytest.approx(600 * 60 / 3_600_000)  # 12 spans of 5 s at 600 W


def test_environment_summary(api, world, fleet):
    summary = api.get("/api/v1/environment/summary", **bearer(world.operator_key)).json()
    assert summary["nodes"] == 3 and summary["offline"] == 1 and summary["online_checkable"] == 2
    assert summary["gpus"] == 3 and summary["gpus_lost"] == 1
    assert summary["gpu_vendors"] == {"nvidia": 2, "ascend": 1}
    acme = api.get("/api/v1/environment/summary", **bearer(world.keys["acme-viewer"])).json()
    assert acme["nodes"] == 2


def test_timestamps_are_utc_with_z(api, world, fleet):
    node = api.get("/api/v1/nodes/shared-1", **bearer(world.operator_key)).json()
    assert node["last_heartbeat_at"].endswith("Z") and node["registered_at"].endswith("Z")
    assert node["gpus"][1]["lost_at"].endswith("Z") and node["gpus"][0]["lost_at"] is None


def test_manual_upsert_merges_labels_checks_keys_and_normalises_the_mac(api, world):
    headers = bearer(world.operator_key)
    api.post("/api/v1/nodes", {"id": "m1", "labels": {"a": "1", "b": "2"}}, format="json", **headers)
    node = api.post(
        "/api/v1/nodes", {"id": "m1", "labels": {"b": "3"}, "mac": "AA-BB-CC-DD-EE-FF"}, format="json", **headers
    ).json()
    assert node["labels"] == {"a": "1", "b": "3"} and node["mac"] == "aa:bb:cc:dd:ee:ff"
    response = api.post("/api/v1/nodes", {"id": "m1", "labels": {"bad key!": "x"}}, format="json", **headers)
    assert response.status_code == 400 and "labels" in response.json()["error"]["fields"]


def test_a_lost_gpu_can_be_removed_by_an_operator_and_only_when_lost(api, world, fleet):
    from apps.alerts.models import Alert
    from apps.alerts.services import raise_alert

    raise_alert(
        type="GPU_LOST",
        severity="error",
        scope="gpu",
        key="GPU_LOST:shared-1:1",
        message="lost",
        node_id="shared-1",
        gpu_index=1,
    )
    headers = bearer(world.operator_key)
    assert api.delete("/api/v1/nodes/shared-1/gpus/0", **headers).status_code == 409
    assert api.delete("/api/v1/nodes/shared-1/gpus/1", **bearer(world.keys["acme-admin"])).status_code == 403
    assert api.delete("/api/v1/nodes/shared-1/gpus/1", **headers).status_code == 204
    assert api.delete("/api/v1/nodes/shared-1/gpus/7", **headers).status_code == 404
    assert list(Gpu.objects.filter(node_id="shared-1").values_list("index", flat=True)) == [0]
    assert Node.objects.get(pk="shared-1").gpu_count == 1
    assert Alert.objects.get(key="GPU_LOST:shared-1:1").state == "RECOVERED"


def test_deleting_a_node_deletes_its_metrics(api, world, fleet):
    insert_metrics("shared-1", [(utcnow(), 1.0, "[]")])
    api.delete("/api/v1/nodes/shared-1", **bearer(world.operator_key))
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM node_metrics WHERE node_id = 'shared-1'")
        assert cursor.fetchone()[0] == 0


def test_a_tenant_with_dedicated_nodes_cannot_be_deleted(api, world, fleet):
    response = api.delete("/api/v1/tenants/acme", **bearer(world.operator_key))
    assert response.status_code == 409 and response.json()["error"]["code"] == "tenant_has_dedicated_nodes"
    assert "acme-1" in response.json()["error"]["message"]


@pytest.mark.parametrize("hours", [1, 6, 24, 72, 100, 168])
def test_any_window_has_at_most_400_points(hours):
    from apps.nodes.metrics import bucket_seconds

    assert hours * 3600 / bucket_seconds(hours) + 1 <= 400
