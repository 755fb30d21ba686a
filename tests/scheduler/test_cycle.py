"""The scheduler's shell against the database: snapshot, bind, ledger, explain."""

import pytest

from apps.core.clock import utcnow
from apps.nodes.models import Gpu, Node
from apps.scheduler.models import GpuAllocation, PluginConfig
from apps.scheduler.services import run_cycle
from apps.scheduler.snapshot import GpuRowCache
from apps.tasks.models import Task
from apps.tasks.services import agent_report, stop_task
from tests.factories import make_node, make_task
from tests.headers import bearer
from tests.scheduler.ledger import ledger_agrees

pytestmark = pytest.mark.django_db


def test_a_cycle_binds_in_queue_order_and_keeps_the_ledger(world):
    acme = world.tenants["acme"]
    make_node("n1", gpus=4)
    low = make_task(acme, gpu_required=4, priority=10)
    high = make_task(acme, gpu_required=4, priority=90)
    result = run_cycle()
    assert result.bound == [high.pk] and list(result.failed) == [low.pk]
    high.refresh_from_db()
    low.refresh_from_db()
    assert (high.status, high.node_id) == ("scheduled", "n1")
    assert low.status == "pending" and low.schedule_reason["code"] == "InsufficientResources"
    assert low.schedule_reason["removed_by"] == {"capacity": 1}
    assert sorted(GpuAllocation.objects.filter(task=high).values_list("gpu_index", flat=True)) == [0, 1, 2, 3]
    assert ledger_agrees()


def test_resources_come_back_when_a_task_ends(world):
    acme = world.tenants["acme"]
    make_node("n1", gpus=2)
    first = make_task(acme, gpu_required=2)
    second = make_task(acme, gpu_required=2)
    run_cycle()
    first.refresh_from_db()
    assert agent_report(first, from_status="scheduled", to_status="running")
    assert agent_report(first, from_status="running", to_status="completed", exit_code=0)
    assert not GpuAllocation.objects.filter(task=first).exists()
    assert run_cycle().bound == [second.pk]
    assert ledger_agrees()


def test_cancelling_a_scheduled_task_releases_its_cards(world):
    acme = world.tenants["acme"]
    make_node("n1", gpus=1)
    task = make_task(acme, gpu_required=1)
    run_cycle()
    task.refresh_from_db()
    stop_task(task)
    assert not GpuAllocation.objects.exists()


def test_the_detail_api_explains_why_a_task_waits(api, world):
    acme = world.tenants["acme"]
    make_node("small", gpus=1)
    make_node("down", gpus=8, status="offline")
    task = make_task(acme, gpu_required=4)
    run_cycle()
    reason = api.get(f"/api/v1/tasks/{task.pk}", **bearer(world.keys["acme-viewer"])).json()["schedule_reason"]
    assert reason["code"] == "InsufficientResources" and reason["removed_by"] == {"capacity": 1}
    assert reason["at"].endswith("+00:00") or reason["at"].endswith("Z")


def test_dedicated_nodes_only_take_their_tenants_tasks(world):
    make_node("acme-only", gpus=8, tenant=world.tenants["acme"])
    beta_task = make_task(world.tenants["beta"], gpu_required=1)
    result = run_cycle()
    assert result.failed[beta_task.pk]["removed_by"] == {"tenant": 1}


def test_binpack_configured_in_the_database_takes_effect_next_cycle(world):
    acme = world.tenants["acme"]
    make_node("busy", gpus=8, cpu_used=80.0, memory_used=80.0)
    make_node("idle", gpus=8, cpu_used=5.0, memory_used=5.0)
    spread = make_task(acme, gpu_required=1, name="spread")
    run_cycle()
    spread.refresh_from_db()
    assert spread.node_id == "idle"
    PluginConfig.objects.create(name="binpack", enabled=True)
    packed = make_task(acme, gpu_required=1, name="packed")
    run_cycle()
    packed.refresh_from_db()
    assert packed.node_id == "busy"


def test_gpu_state_shows_busy_cards(api, world):
    make_node("n1", gpus=2)
    make_task(world.tenants["acme"], gpu_required=1)
    run_cycle()
    states = [g["state"] for g in api.get("/api/v1/nodes/n1", **bearer(world.operator_key)).json()["gpus"]]
    assert states == ["busy", "available"]


def test_the_tick_feeds_the_health_endpoint(client, world):
    from apps.scheduler.jobs import tick_job

    assert tick_job() == "ran"
    assert client.get("/health/detail").json()["scheduler"] == "running"


def test_dry_run_says_where_and_why_and_binds_nothing(api, world):
    make_node("n1", gpus=2, region="r1")
    make_node("n2", gpus=8, tenant=world.tenants["beta"])
    headers = bearer(world.keys["acme-viewer"])
    fits = api.post("/api/v1/scheduler/dry-run", {"gpu_required": 2}, format="json", **headers).json()
    assert fits == {"placed": True, "node_id": "n1", "gpu_indices": [0, 1], "score": fits["score"], "reason": None}
    too_big = api.post("/api/v1/scheduler/dry-run", {"gpu_required": 4}, format="json", **headers).json()
    assert too_big["placed"] is False and too_big["reason"]["code"] == "InsufficientResources"
    assert too_big["reason"]["removed_by"] == {"tenant": 1, "capacity": 1}
    assert not GpuAllocation.objects.exists() and not Task.objects.exists()
    assert (
        api.post(
            "/api/v1/scheduler/dry-run", {"gpu_required": 1}, format="json", **bearer(world.operator_key)
        ).status_code
        == 400
    )
    assert api.post(
        "/api/v1/scheduler/dry-run", {"gpu_required": 1, "tenant": "acme"}, format="json", **bearer(world.operator_key)
    ).json()["placed"]
    assert api.post("/api/v1/scheduler/dry-run", {"nodes": 1}, format="json", **headers).status_code == 400


# --- GPU rows reused between cycles (HETEROFLOW_SCHEDULER_GPU_REUSE_SECONDS) ------------


@pytest.fixture
def reuse_gpu_rows(settings):
    """The GPU rows a scheduler process keeps between its cycles (as the tick does)."""
    settings.HETEROFLOW_SCHEDULER_GPU_REUSE_SECONDS = 60
    return GpuRowCache()


def test_reused_gpu_rows_take_their_holders_from_the_ledger_every_cycle(world, reuse_gpu_rows):
    acme = world.tenants["acme"]
    make_node("n1", gpus=1)
    first = make_task(acme, gpu_required=1, name="first")
    assert run_cycle(gpu_rows=reuse_gpu_rows).bound == [first.pk]
    second = make_task(acme, gpu_required=1, name="second")
    assert run_cycle(gpu_rows=reuse_gpu_rows).bound == []  # the reused card is held, as the ledger says
    first.refresh_from_db()
    stop_task(first)  # scheduled → cancelled: the card is free in the ledger
    assert run_cycle(gpu_rows=reuse_gpu_rows).bound == [second.pk]
    assert ledger_agrees()


def test_a_card_lost_since_the_rows_were_read_is_not_bound(world, reuse_gpu_rows):
    acme = world.tenants["acme"]
    make_node("n1", gpus=1)
    warm_up = make_task(acme, gpu_required=1, name="warm-up")
    run_cycle(gpu_rows=reuse_gpu_rows)  # reads (and keeps) the GPU rows
    warm_up.refresh_from_db()
    stop_task(warm_up)
    Gpu.objects.filter(node_id="n1", index=0).update(lost_at=utcnow())
    late = make_task(acme, gpu_required=1, name="late")
    result = run_cycle(gpu_rows=reuse_gpu_rows)
    assert result.bound == [] and result.lost_races == [late.pk]  # decided on the old rows, refused at bind
    late.refresh_from_db()
    assert late.status == "pending" and not GpuAllocation.objects.exists()


def test_a_new_node_makes_the_rows_be_read_again(world, reuse_gpu_rows):
    acme = world.tenants["acme"]
    make_node("n1", gpus=1)
    run_cycle(gpu_rows=reuse_gpu_rows)
    make_task(acme, gpu_required=1, name="fills-n1")
    run_cycle(gpu_rows=reuse_gpu_rows)
    make_node("n2", gpus=1)
    late = make_task(acme, gpu_required=1, name="late")
    assert run_cycle(gpu_rows=reuse_gpu_rows).bound == [late.pk]
    late.refresh_from_db()
    assert late.node_id == "n2"


def test_nodes_without_cards_do_not_defeat_the_reuse(world, reuse_gpu_rows):
    make_node("n1", gpus=2)
    make_node("cpu-only", gpus=0)
    make_task(world.tenants["acme"], gpu_required=1, name="a")
    run_cycle(gpu_rows=reuse_gpu_rows)
    first_read = reuse_gpu_rows.rows
    make_task(world.tenants["acme"], gpu_required=1, name="b")
    run_cycle(gpu_rows=reuse_gpu_rows)
    assert reuse_gpu_rows.rows is first_read


def test_bind_rechecks_the_card_thresholds_on_the_live_rows(world, reuse_gpu_rows):
    acme = world.tenants["acme"]
    make_node("n1", gpus=1)
    warm_up = make_task(acme, gpu_required=1, name="warm-up")
    run_cycle(gpu_rows=reuse_gpu_rows)  # reads (and keeps) the GPU rows: the card is cool
    warm_up.refresh_from_db()
    stop_task(warm_up)
    Gpu.objects.filter(node_id="n1").update(temperature=85.0)  # hot since the rows were read
    late = make_task(acme, gpu_required=1, name="late")
    result = run_cycle(gpu_rows=reuse_gpu_rows)
    assert result.bound == [] and result.lost_races == [late.pk]
    Gpu.objects.filter(node_id="n1").update(temperature=60.0, memory_used_mb=81000)  # 98.9 % of 81920
    assert run_cycle(gpu_rows=reuse_gpu_rows).bound == []
    Gpu.objects.filter(node_id="n1").update(memory_used_mb=1000)
    assert run_cycle(gpu_rows=reuse_gpu_rows).bound == [late.pk]


def test_a_node_the_alert_sweep_calls_offline_takes_nothing_while_still_suspect(world):
    """Silent for more than HETEROFLOW_NODE_OFFLINE_SECONDS (45 s), its status is still
    suspect until 60 s; a task requeued from it must not be placed back on it."""
    from datetime import timedelta

    make_node("silent", gpus=1, status="suspect")
    Node.objects.filter(pk="silent").update(last_heartbeat_at=utcnow() - timedelta(seconds=46))
    make_node("quiet", gpus=1, status="suspect")
    Node.objects.filter(pk="quiet").update(last_heartbeat_at=utcnow() - timedelta(seconds=40))
    task = make_task(world.tenants["acme"], gpu_required=1)
    assert run_cycle().bound == [task.pk]
    task.refresh_from_db()
    assert task.node_id == "quiet"
    second = make_task(world.tenants["acme"], gpu_required=1)
    assert run_cycle().bound == [] and Task.objects.get(pk=second.pk).status == "pending"
