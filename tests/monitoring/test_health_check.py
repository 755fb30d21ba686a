"""The six-point health check (operators) and the caller-scoped health detail."""

import pytest

from apps.core.clock import utcnow
from apps.core.models import JobRun
from apps.monitoring import checks, probes
from apps.nodes.models import Gpu
from apps.scheduler.models import GpuAllocation
from tests.factories import make_node, make_task
from tests.headers import AGENT, bearer
from tests.live import free_port

pytestmark = pytest.mark.django_db


def scheduler_ticked():
    JobRun.objects.create(key=probes.SCHEDULER_JOB_KEY, last_started_at=utcnow(), last_finished_at=utcnow())


def test_the_check_names_six_dimensions_and_a_verdict(world, api):
    scheduler_ticked()
    make_node("g1", gpus=2)
    body = api.get("/api/v1/server/health-check", **bearer(world.operator_key)).json()
    assert [check["name"] for check in body["checks"]] == [
        "database",
        "storage",
        "scheduler",
        "gpu_nodes",
        "broker",
        "configuration",
    ]
    statuses = {check["name"]: check["status"] for check in body["checks"]}
    assert statuses == dict.fromkeys(statuses, "ok"), body
    assert body["status"] == "healthy"
    assert {check["name"]: check["details"] for check in body["checks"]}["broker"]["ping_ms"] >= 0


def test_a_cluster_without_scheduler_or_gpu_nodes_is_degraded_and_says_why(world, api):
    body = api.get("/api/v1/server/health-check", **bearer(world.operator_key)).json()
    by_name = {check["name"]: check for check in body["checks"]}
    assert by_name["scheduler"]["status"] == "error" and by_name["scheduler"]["suggestion"]
    assert by_name["gpu_nodes"]["status"] == "warning"
    assert body["status"] == "degraded"


def test_the_broker_check_really_pings():
    assert checks.check_broker().status == "ok"
    failed = checks.check_broker(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    assert failed.status == "error" and "PING" in failed.message and failed.suggestion


def test_the_database_check_runs_a_query():
    make_node("g1", gpus=2)
    result = checks.check_database()
    assert result.status == "ok" and result.details["nodes"] == 1


@pytest.mark.parametrize("percent,expected", [(50.0, "ok"), (90.0, "ok"), (91.0, "warning"), (98.0, "error")])
def test_storage_thresholds(percent, expected):
    def usage(path):
        total = 1000
        used = int(total * percent / 100)
        return total, used, total - used

    result = checks.check_storage({"root": "/", "data": "/data"}, usage=usage)
    assert result.status == expected
    assert set(result.details["disks"]) == {"root", "data"}


@pytest.mark.parametrize(
    "running,pending,oldest,expected",
    [
        (False, 0, None, "error"),
        (False, 50, 900.0, "error"),  # not running wins over the backlog
        (True, 11, 5.0, "warning"),
        (True, 1, 301.0, "warning"),
        (True, 10, 300.0, "ok"),
        (True, 0, None, "ok"),
    ],
)
def test_scheduler_evaluation_has_one_path_per_outcome(running, pending, oldest, expected):
    status, message, suggestion = checks.evaluate_scheduler(running, pending, oldest)
    assert status == expected
    assert bool(suggestion) == (expected != "ok")


def test_a_backlog_shows_in_the_scheduler_check(world):
    scheduler_ticked()
    for _ in range(11):
        make_task(world.tenants["acme"])
    result = checks.check_scheduler(utcnow())
    assert result.status == "warning" and result.details["pending"] == 11


def test_unapplied_migrations_fail_the_configuration_check():
    assert checks.check_configuration().status == "ok"
    result = checks.check_configuration(pending_migrations=lambda: ["monitoring.0002_future"])
    assert result.status == "error" and result.details["unapplied_migrations"] == ["monitoring.0002_future"]


def check(name, status):
    return checks.Check(name, status, "")


@pytest.mark.parametrize(
    "statuses,expected",
    [
        ({}, "healthy"),
        ({"gpu_nodes": "warning"}, "degraded"),
        ({"gpu_nodes": "warning", "scheduler": "error"}, "degraded"),
        ({"gpu_nodes": "warning", "scheduler": "error", "storage": "warning"}, "unhealthy"),
        ({"database": "error"}, "unhealthy"),
    ],
)
def test_overall_verdict(statuses, expected):
    names = ["database", "storage", "scheduler", "gpu_nodes", "broker", "configuration"]
    assert checks.overall([check(name, statuses.get(name, "ok")) for name in names]) == expected


# --- /api/v1/health/detail ---------------------------------------------------------------------


@pytest.fixture
def cluster(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    make_node("shared", gpus=4)
    make_node("acme-box", gpus=2, tenant=acme)
    make_node("beta-box", gpus=8, tenant=beta)
    make_node("gone", gpus=1, status="offline")
    Gpu.objects.filter(node_id="shared", index=3).update(lost_at=utcnow())
    running = make_task(acme, name="a", status="running", node_id="shared", gpu_required=1)
    GpuAllocation.objects.create(task=running, node_id="shared", gpu_index=0, tenant=acme)
    make_task(acme, name="b")
    beta_task = make_task(beta, name="c", status="running", node_id="beta-box", gpu_required=2)
    for index in (0, 1):
        GpuAllocation.objects.create(task=beta_task, node_id="beta-box", gpu_index=index, tenant=beta)


def test_health_detail_is_narrowed_to_what_the_caller_may_see(world, api, cluster):
    acme = api.get("/api/v1/health/detail", **bearer(world.keys["acme-viewer"])).json()
    gpus = acme["checks"]["gpu_resources"]
    # shared (4, one lost) + acme's own (2) + the offline shared node (1); never beta's 8
    assert (gpus["total"], gpus["online"], gpus["lost"], gpus["busy"]) == (7, 5, 1, 1)
    assert (gpus["nodes"], gpus["nodes_online"]) == (3, 2)
    assert acme["checks"]["tasks"]["total"] == 2 and acme["checks"]["tasks"]["running"] == 1
    assert "plugins" not in acme["checks"]
    operator = api.get("/api/v1/health/detail", **bearer(world.operator_key)).json()
    assert operator["checks"]["gpu_resources"]["total"] == 15 and operator["checks"]["gpu_resources"]["busy"] == 3
    assert operator["checks"]["tasks"]["total"] == 3
    assert {plugin["name"] for plugin in operator["checks"]["plugins"]} >= {"gpu-filter", "spread"}
    beta = api.get("/api/v1/health/detail", **bearer(world.keys["beta-admin"])).json()
    assert beta["checks"]["gpu_resources"]["total"] == 13 and beta["checks"]["tasks"]["total"] == 1


@pytest.mark.parametrize("who,expected", [("anonymous", 401), ("agent", 403), ("acme-viewer", 200), ("operator", 200)])
def test_health_detail_needs_a_person(world, api, settings, who, expected):
    headers = {"anonymous": {}, "agent": AGENT, "operator": bearer(world.operator_key)}.get(who, None)
    response = api.get("/api/v1/health/detail", **(headers if headers is not None else bearer(world.keys[who])))
    assert response.status_code == expected


def test_health_detail_status_follows_the_scheduler(world, api):
    assert api.get("/api/v1/health/detail", **bearer(world.operator_key)).json()["status"] == "degraded"
    scheduler_ticked()
    body = api.get("/api/v1/health/detail", **bearer(world.operator_key)).json()
    assert body["status"] == "ok" and body["checks"]["scheduler"] == "running"


def test_unauthenticated_detail_probe_carries_no_error_text(client, monkeypatch):
    real = probes.database_params
    monkeypatch.setattr(
        probes, "database_params", lambda **o: real(**o) | {"host": "127.0.0.1", "port": str(free_port())}
    )
    response = client.get("/health/detail")
    assert response.status_code == 503
    assert response.json() == {"status": "unhealthy", "database": "unreachable", "scheduler": "unknown"}
