"""Hard constraints through the real cycle and the API (docs/scheduler.md#hard-constraints):
node affinity and anti-affinity, the runtime against the node's exec_mode, a service's
replicas kept apart; explain and the dry runs name the filter that removed each node and
say in words what no node has. And preemption for a decision refused at bind because its
node changed (docs/scheduler.md#preemption), considered once."""

import pytest

from apps.nodes.choices import CORDON_LABEL
from apps.nodes.models import Node
from apps.scheduler import cycle
from apps.scheduler import preemption as shell_preemption
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task
from apps.tasks.services import create_task
from tests.factories import make_group, make_node, make_task_holding
from tests.headers import bearer
from tests.scheduler.ledger import ledger_agrees

pytestmark = pytest.mark.django_db


def explain(api, world, task):
    response = api.get(f"/api/v1/tasks/{task.pk}/explain", **bearer(world.keys["acme-viewer"]))
    assert response.status_code == 200, response.content
    return response.json()


def dry_run(api, world, path="", **body):
    return api.post(f"/api/v1/scheduler/dry-run{path}", body, format="json", **bearer(world.keys["acme-viewer"]))


# --- affinity and anti-affinity ------------------------------------------------------------


def test_affinity_binds_only_on_labelled_nodes_and_explain_names_a_label_no_node_has(api, world):
    acme = world.tenants["acme"]
    make_node("a1", gpus=2, labels={"gpu-pool": "a100"})
    make_node("b1", gpus=2, labels={"gpu-pool": "h100"})
    make_node("c1", gpus=2, labels={"gpu-pool": "a100", CORDON_LABEL: "maintenance"})  # out of service
    wanting = [
        create_task(
            tenant=acme, name=f"w{n}", image="x", gpu_required=1, affinity={"nodes_with_labels": {"gpu-pool": "a100"}}
        )
        for n in range(3)
    ]
    result = run_cycle()
    assert sorted(result.bound) == sorted(t.pk for t in wanting[:2])
    assert set(Task.objects.filter(pk__in=result.bound).values_list("node_id", flat=True)) == {"a1"}
    assert result.failed[wanting[2].pk]["removed_by"] == {"unavailable": 1, "capacity": 1, "affinity": 1}

    missing = create_task(
        tenant=acme, name="missing", image="x", gpu_required=1, affinity={"nodes_with_labels": {"gpu-pool": "b200"}}
    )
    run_cycle()
    missing.refresh_from_db()
    assert missing.schedule_reason["removed_by"] == {"unavailable": 1, "affinity": 2}
    answer = explain(api, world, missing)
    reason = answer["now"]["reason"]
    assert reason["message"] == "affinity: no schedulable node has the label gpu-pool=b200"
    assert reason["nodes"] == [
        {"node_id": "a1", "filter": "affinity"},
        {"node_id": "b1", "filter": "affinity"},
        {"node_id": "c1", "filter": "unavailable"},
    ]
    assert ledger_agrees()


def test_anti_affinity_keeps_a_task_off_labelled_nodes(world):
    acme = world.tenants["acme"]
    make_node("a1", gpus=1, labels={"maintenance": "soon"})
    make_node("b1", gpus=1)
    avoiding = [
        create_task(
            tenant=acme, name=f"t{n}", image="x", gpu_required=1, anti_affinity={"labels": {"maintenance": "soon"}}
        )
        for n in range(2)
    ]
    result = run_cycle()
    assert len(result.bound) == 1 and Task.objects.get(pk=result.bound[0]).node_id == "b1"
    assert result.failed[avoiding[1].pk]["removed_by"] == {"capacity": 1, "anti_affinity": 1}


# --- the runtime a task accepts --------------------------------------------------------------


def test_the_runtime_follows_the_nodes_exec_mode_and_explain_names_it(api, world):
    acme = world.tenants["acme"]
    make_node("docker-1", gpus=2, exec_mode="docker")
    make_node("proc-1", gpus=2, exec_mode="process")
    process = create_task(tenant=acme, name="p", image="", runtime="process", gpu_required=1)
    container = [
        create_task(tenant=acme, name=f"c{n}", image="x", runtime="container", gpu_required=1) for n in range(3)
    ]
    auto = create_task(tenant=acme, name="a", image="x", gpu_required=1)  # the default: either
    result = run_cycle()
    where = dict(Task.objects.filter(pk__in=result.bound).values_list("pk", "node_id"))
    assert where[process.pk] == "proc-1"
    assert {where[t.pk] for t in container if t.pk in where} == {"docker-1"}
    assert auto.pk in where
    waiting = next(t for t in container if t.pk not in where)
    assert result.failed[waiting.pk]["removed_by"] == {"capacity": 1, "runtime": 1}

    # a process task on a fleet with no node that runs processes: explained, in words
    Node.objects.filter(pk="proc-1").update(exec_mode="docker")
    lonely = create_task(tenant=acme, name="lonely", image="", runtime="process", gpu_required=0)
    run_cycle()
    reason = explain(api, world, lonely)["now"]["reason"]
    assert reason["removed_by"] == {"runtime": 2}
    assert reason["message"] == (
        "runtime process: 2 nodes run tasks only in containers; no schedulable node runs processes "
        "(an agent with the process runtime)"
    )


# --- a service's replicas --------------------------------------------------------------------


def test_replicas_kept_apart_never_share_a_node_even_across_cycles(world):
    acme = world.tenants["acme"]
    make_node("a1", gpus=4)
    make_node("b1", gpus=4)
    service = make_group(
        acme,
        workers=3,
        gpus=1,
        kind="inference",
        placement="replicas",
        members={"anti_affinity": {"same_service": True}, "serving": {}},
    )
    replicas = list(service.tasks.order_by("rank"))
    result = run_cycle()
    assert len(result.bound) == 2
    assert set(Task.objects.filter(pk__in=result.bound).values_list("node_id", flat=True)) == {"a1", "b1"}
    third = next(t for t in replicas if t.pk not in result.bound)
    assert result.failed[third.pk]["removed_by"] == {"same_service": 2}
    # a later cycle reads where its siblings are bound: still apart
    assert run_cycle().bound == []
    make_node("c1", gpus=4)
    assert run_cycle().bound == [third.pk] and Task.objects.get(pk=third.pk).node_id == "c1"


# --- the dry runs --------------------------------------------------------------------------


def test_the_dry_runs_take_the_constraints_and_name_the_filter(api, world):
    make_node("a1", gpus=8, labels={"fabric": "ib"})
    make_node("b1", gpus=8, exec_mode="process")
    answer = dry_run(api, world, affinity={"nodes_with_labels": {"fabric": "ib"}}).json()
    assert (answer["placed"], answer["node_id"]) == (True, "a1")
    answer = dry_run(api, world, runtime="process").json()
    assert (answer["placed"], answer["node_id"]) == (True, "b1")
    answer = dry_run(api, world, affinity={"nodes_with_labels": {"fabric": "roce"}}).json()
    assert answer["placed"] is False
    assert answer["reason"]["removed_by"] == {"affinity": 2}
    assert answer["reason"]["message"] == "affinity: no schedulable node has the label fabric=roce"
    assert [n["filter"] for n in answer["reason"]["nodes"]] == ["affinity", "affinity"]
    refused = dry_run(api, world, anti_affinity={"same_service": True})
    assert refused.status_code == 400 and "same_service" in refused.json()["error"]["fields"]["anti_affinity"]
    group = dry_run(
        api,
        world,
        "/group",
        world_size=2,
        gpus_per_worker=8,
        gpu_type="nvidia",
        affinity={"nodes_with_labels": {"fabric": "ib"}},
    ).json()
    assert group["placed"] is False and group["reason"]["removed_by"] == {"affinity": 1}
    one = dry_run(
        api,
        world,
        "/group",
        world_size=1,
        gpus_per_worker=8,
        gpu_type="nvidia",
        affinity={"nodes_with_labels": {"fabric": "ib"}},
    ).json()
    assert [w["node_id"] for w in one["workers"]] == ["a1"]
    assert not Task.objects.exists() and not GpuAllocation.objects.exists()


# --- preemption for a decision refused at bind -------------------------------------------------


@pytest.fixture
def watched(monkeypatch):
    """What preemption planning was asked, task by task."""
    asked: list[tuple[int, str]] = []
    real_plan = shell_preemption.plan_preemption

    def plan(task, *args, **kwargs):
        asked.append(task.id)
        return real_plan(task, *args, **kwargs)

    monkeypatch.setattr(shell_preemption, "plan_preemption", plan)
    return asked


def after_the_snapshot(monkeypatch, change):
    real = cycle.load_nodes

    def snapshot_then_change(*args, **kwargs):
        nodes = real(*args, **kwargs)
        change()
        return nodes

    monkeypatch.setattr(cycle, "load_nodes", snapshot_then_change)


def test_cards_taken_before_bind_trigger_preemption_once_in_the_same_cycle(world, monkeypatch, watched):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    node = make_node("n1", gpus=1)
    high = create_task(tenant=acme, name="high", image="x", gpu_required=1, priority=90)
    racer = {}

    def another_scheduler_binds_a_low_job():
        low = make_task_holding(node, beta, "running")
        Task.objects.filter(pk=low.pk).update(preemptible=True, priority=10)
        racer["low"] = low

    after_the_snapshot(monkeypatch, another_scheduler_binds_a_low_job)
    result = run_cycle()
    low = racer["low"]
    assert result.bound == [] and result.lost_races == [high.pk]
    assert watched == [high.pk]  # considered once, in this cycle
    assert result.preemptions[high.pk].victims == [low.pk]
    low.refresh_from_db()
    high.refresh_from_db()
    assert low.status == "preempting" and high.status == "pending"
    reason = high.schedule_reason
    assert (reason["code"], reason["cause"]) == ("PreemptionPending", "InsufficientResources")
    assert reason["message"] == "placed on n1, whose chosen cards were taken or became unusable before it was bound"
    assert reason["preemption"] == {"node_id": "n1", "victims": [low.pk]}
    assert ledger_agrees()


def test_a_node_gone_before_bind_triggers_preemption_elsewhere_once(world, monkeypatch, watched):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    make_node("a-free", gpus=1)
    busy = make_node("b-busy", gpus=1)
    low = make_task_holding(busy, beta, "running")
    Task.objects.filter(pk=low.pk).update(preemptible=True, priority=10)
    high = create_task(tenant=acme, name="high", image="x", gpu_required=1, priority=90)
    after_the_snapshot(monkeypatch, lambda: Node.objects.filter(pk="a-free").update(executable=False))
    result = run_cycle()
    assert result.bound == [] and result.lost_races == [high.pk]
    assert watched == [high.pk]
    assert (result.preemptions[high.pk].node_id, result.preemptions[high.pk].victims) == ("b-busy", [low.pk])
    high.refresh_from_db()
    assert (high.schedule_reason["code"], high.schedule_reason["cause"]) == ("PreemptionPending", "NoSchedulableNodes")
    assert high.schedule_reason["message"] == "placed on a-free, which took no more work by the time it was bound"


def test_a_refusal_with_nothing_to_evict_is_explained_and_evicts_nobody(world, monkeypatch, watched):
    acme = world.tenants["acme"]
    make_node("n1", gpus=1)
    high = create_task(tenant=acme, name="high", image="x", gpu_required=1, priority=90)
    after_the_snapshot(monkeypatch, lambda: Node.objects.filter(pk="n1").update(status="offline"))
    result = run_cycle()
    assert result.lost_races == [high.pk] and not result.preemptions
    high.refresh_from_db()
    assert high.status == "pending" and high.schedule_reason["code"] == "NoSchedulableNodes"
    assert high.schedule_reason["message"] == "placed on n1, which took no more work by the time it was bound"
    assert not Task.objects.filter(status="preempting").exists()


def test_a_task_that_lost_its_compare_and_set_is_not_a_refusal(world, monkeypatch, watched):
    """Bound by another scheduler meanwhile (no longer pending): nothing to explain or preempt."""
    acme = world.tenants["acme"]
    node = make_node("n1", gpus=2)
    high = create_task(tenant=acme, name="high", image="x", gpu_required=1, priority=90)
    after_the_snapshot(monkeypatch, lambda: Task.objects.filter(pk=high.pk).update(status="scheduled", node=node))
    result = run_cycle()
    assert result.lost_races == [high.pk] and watched == [] and high.pk not in result.failed
