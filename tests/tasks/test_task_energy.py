"""A task's energy from its cards' accumulators (docs/energy.md#tasks): bind keeps each
card's gpus.energy_wh, leaving the node adds the growth × share, with carbon under the
node's factor then; usage records carry it; GET /api/v1/usage/energy sums a tenant's.
The heartbeat's accumulators are set here as it leaves them."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.nodes.models import EmissionFactor, Gpu, Node
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.tasks.models import UsageRecord
from apps.tasks.services import agent_report, move_tasks
from tests.factories import make_node, make_task
from tests.headers import bearer

pytestmark = pytest.mark.django_db


def meter(node_id, index, wh, *, power=True):
    """The card's accumulator as the heartbeat leaves it (power measured now)."""
    now = utcnow()
    Gpu.objects.filter(node_id=node_id, index=index).update(
        energy_wh=wh, energy_since=now - timedelta(hours=1), **({"power_at": now} if power else {})
    )


def bound(task):
    assert task.pk in run_cycle().bound
    task.refresh_from_db()
    return task


def finish(task, status="completed"):
    assert agent_report(task, from_status="scheduled", to_status="running")
    assert agent_report(task, from_status="running", to_status=status, exit_code=0 if status == "completed" else 1)
    task.refresh_from_db()
    return task


def test_whole_cards_from_bind_to_end_with_the_region_factor(world):
    make_node("n1", gpus=2, region="eu-north")
    EmissionFactor.objects.create(region="eu-north", g_co2e_per_kwh=300.0)
    meter("n1", 0, 1_000.0)
    meter("n1", 1, 2_000.0)
    task = bound(make_task(world.tenants["acme"], gpu_required=2))
    assert sorted(GpuAllocation.objects.filter(task=task).values_list("gpu_index", "energy_wh_at_bind")) == [
        (0, 1_000.0),
        (1, 2_000.0),
    ]
    meter("n1", 0, 1_500.0)
    meter("n1", 1, 2_300.0)
    task = finish(task)
    assert task.energy_wh == pytest.approx(800.0)
    assert task.carbon_g == pytest.approx(0.8 * 300.0) and task.energy_wh_unfactored == 0.0
    record = UsageRecord.objects.get(task=task)
    assert (record.energy_wh, record.carbon_g, record.energy_wh_unfactored) == (
        pytest.approx(800.0),
        pytest.approx(240.0),
        0.0,
    )


def test_a_share_counts_its_memory_fraction_and_no_factor_leaves_it_unfactored(world):
    make_node("plain", 1, memory_total_mb=80_000)
    meter("plain", 0, 10_000.0)
    task = bound(make_task(world.tenants["acme"], gpu_required=0, gpu_memory_mb=20_000))
    assert GpuAllocation.objects.get(task=task).memory_mb == 20_000
    meter("plain", 0, 10_400.0)
    task = finish(task)
    assert task.energy_wh == pytest.approx(100.0)  # 400 Wh × 20000 / 80000
    assert task.carbon_g is None and task.energy_wh_unfactored == pytest.approx(100.0)
    record = UsageRecord.objects.get(task=task)
    assert record.carbon_g is None and record.energy_wh_unfactored == pytest.approx(100.0)


def test_the_node_factor_at_the_end_is_the_one_used(world):
    make_node("own", gpus=1, region="eu-north", emission_factor_g_per_kwh=50.0)
    EmissionFactor.objects.create(region="eu-north", g_co2e_per_kwh=300.0)
    task = bound(make_task(world.tenants["acme"], gpu_required=1))
    meter("own", 0, 2_000.0)
    Node.objects.filter(pk="own").update(emission_factor_g_per_kwh=80.0)  # changed while it ran
    task = finish(task, "failed")
    assert task.energy_wh == pytest.approx(2_000.0) and task.carbon_g == pytest.approx(160.0)


def test_a_task_whose_cards_measured_no_power_keeps_null_not_0(world):
    make_node("dark", gpus=1)
    task = bound(make_task(world.tenants["acme"], gpu_required=1))
    task = finish(task)
    assert task.energy_wh is None and task.carbon_g is None and task.energy_wh_unfactored == 0.0
    record = UsageRecord.objects.get(task=task)
    assert record.energy_wh is None and record.carbon_g is None


def test_a_reading_after_bind_with_no_growth_is_a_measured_0(world):
    make_node("idle", gpus=1)
    meter("idle", 0, 500.0, power=False)
    task = bound(make_task(world.tenants["acme"], gpu_required=1))
    Gpu.objects.filter(node_id="idle").update(power_at=utcnow() + timedelta(seconds=1))
    task = finish(task)
    assert task.energy_wh == 0.0


def test_each_run_adds_and_the_accumulator_between_runs_is_not_the_tasks(world):
    make_node("n1", gpus=1, emission_factor_g_per_kwh=100.0)
    task = bound(make_task(world.tenants["acme"], gpu_required=1))
    meter("n1", 0, 1_000.0)
    assert agent_report(task, from_status="scheduled", to_status="running")
    assert move_tasks(task.pk, ("running",), "pending") == [task.pk]  # back to the queue: the run counts
    task.refresh_from_db()
    assert task.energy_wh == pytest.approx(1_000.0) and not GpuAllocation.objects.filter(task=task).exists()
    meter("n1", 0, 5_000.0)  # someone else's use while it waited
    task = bound(task)
    assert GpuAllocation.objects.get(task=task).energy_wh_at_bind == 5_000.0
    meter("n1", 0, 5_500.0)
    task = finish(task)
    assert task.energy_wh == pytest.approx(1_500.0) and task.carbon_g == pytest.approx(150.0)


def test_a_card_held_before_energy_was_kept_is_not_counted(world):
    node = make_node("old", gpus=1)
    acme = world.tenants["acme"]
    task = make_task(acme, status="running", node=node, gpu_required=1, running_since=utcnow())
    GpuAllocation.objects.create(task=task, node=node, gpu_index=0, tenant=acme)  # no energy_wh_at_bind
    meter("old", 0, 9_999.0)
    move_tasks(task.pk, ("running",), "completed")
    task.refresh_from_db()
    assert task.energy_wh is None


# --- the tenant's view --------------------------------------------------------------------------


def usage(api, key, query=""):
    response = api.get(f"/api/v1/usage/energy{query}", **bearer(key))
    assert response.status_code == 200, response.content
    return response.json()


def test_the_tenant_view_sums_settled_and_running_tasks(api, world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    make_node("n1", gpus=2, emission_factor_g_per_kwh=200.0)
    make_node("n2", gpus=1)  # no factor
    done = bound(make_task(acme, name="done", gpu_required=1, gpu_type="nvidia"))
    meter(done.node_id, GpuAllocation.objects.get(task=done).gpu_index, 3_000.0)
    finish(done)
    Node.objects.filter(pk="n1").update(executable=False)  # the next ones go to n2
    running = bound(make_task(acme, name="running", gpu_required=1))
    assert running.node_id == "n2"
    assert agent_report(running, from_status="scheduled", to_status="running")
    meter("n2", 0, 500.0)
    dark = make_task(beta, name="beta-dark", gpu_required=1)  # beta's: not acme's
    UsageRecord.objects.create(
        task=dark, tenant=beta, gpus=1, gpu_seconds=7200.0, ended_status="completed", settled_at=utcnow()
    )

    member = usage(api, world.keys["acme-member"])
    assert member["tenant"] == "acme" and member["tasks_settled"] == 1 and member["tasks_running"] == 1
    assert member["tasks_measured"] == 2
    assert member["energy_kwh"] == pytest.approx(3.5)
    assert member["carbon"] == {"basis": "partial", "carbon_g": pytest.approx(600.0), "unfactored_kwh": 0.5}
    assert [(t["name"], t["running"], t["energy_kwh"]) for t in member["top_tasks"]] == [
        ("done", False, pytest.approx(3.0)),
        ("running", True, pytest.approx(0.5)),
    ]
    assert member["top_tasks"][1]["carbon"]["basis"] == "no_factor"
    assert "configure" not in member["top_tasks"][1]["carbon"]  # operators are told how
    assert usage(api, world.keys["acme-member"], "?top=1")["top_tasks"][0]["name"] == "done"
    operator = usage(api, world.operator_key, "?tenant=acme")
    assert (operator["tenant"], operator["energy_kwh"], operator["carbon"]) == ("acme", 3.5, member["carbon"])
    assert "PUT /api/v1/admin/emission-factors/" in operator["top_tasks"][1]["carbon"]["configure"]
    # beta: one task, never measured: null energy, no carbon figure, and no 0
    beta_view = usage(api, world.keys["beta-viewer"])
    assert beta_view["gpu_hours"] == pytest.approx(2.0) and beta_view["energy_kwh"] is None
    assert beta_view["carbon"] == {"basis": "no_data", "carbon_g": None, "unfactored_kwh": None}
    assert beta_view["top_tasks"] == []
    # another tenant's view is not found, not forbidden; the window is bounded
    assert api.get("/api/v1/usage/energy?tenant=acme", **bearer(world.keys["beta-admin"])).status_code == 404
    assert api.get("/api/v1/usage/energy?days=0", **bearer(world.keys["acme-admin"])).status_code == 400
    assert api.get("/api/v1/usage/energy?days=367", **bearer(world.keys["acme-admin"])).status_code == 400
    # operators without ?tenant: the whole platform
    platform = usage(api, world.operator_key)
    assert platform["tenant"] is None and platform["tasks_settled"] == 2


def test_the_window_leaves_out_older_records_and_operators_learn_how_to_configure(api, world):
    acme = world.tenants["acme"]
    old = make_task(acme, name="old", status="completed")
    UsageRecord.objects.create(
        task=old,
        tenant=acme,
        gpus=1,
        gpu_seconds=3600.0,
        energy_wh=900.0,
        energy_wh_unfactored=900.0,
        ended_status="completed",
        settled_at=utcnow() - timedelta(days=10),
    )
    assert usage(api, world.keys["acme-admin"], "?days=7")["energy_kwh"] is None
    month = usage(api, world.operator_key, "?tenant=acme&days=30")
    assert month["energy_kwh"] == pytest.approx(0.9)
    assert month["carbon"]["basis"] == "no_factor" and month["carbon"]["carbon_g"] is None
    assert "PUT /api/v1/admin/emission-factors/" in month["carbon"]["configure"]
    assert "configure" not in usage(api, world.keys["acme-admin"], "?days=30")["carbon"]
