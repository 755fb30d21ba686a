"""Model distribution as a placement input (docs/scheduler.md#model-distribution, spec 004's resource
pre-filter): a replica whose model is pinned to nodes runs only there (`model_pinned`),
a node that holds the model outranks one that would fetch it (`score_model_cache`), and
a node running the most inference replicas it may takes no further one
(`inference_cap`); the snapshot reads all of it in a fixed number of queries."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings

from apps.nodes.model_cache import CACHED_MODELS_LABEL
from apps.scheduler.core import (
    MODEL_CACHED,
    NEUTRAL,
    ModelSpread,
    PluginSettings,
    model_words,
    place,
    rejections,
    score_model_cache,
)
from apps.scheduler.services import load_nodes, run_cycle
from apps.tasks.models import Task
from tests.factories import make_node, make_task, make_task_holding
from tests.headers import bearer
from tests.inference.service_rows import make_model, make_service
from tests.scheduler.ledger import ledger_agrees
from tests.scheduler.snapshots import SAME_TENANT_ONLY, node, task


def replica(id, service=7, **kw):
    return task(id=id, kind="inference", replica_of=service, **kw)


def fleet(*ids, models: ModelSpread, **kw):
    return [node(id, 8, models=models, **kw) for id in ids]


def place_on(tasks, nodes, settings=None):
    return place(tasks, nodes, settings or PluginSettings(), SAME_TENANT_ONLY)


# --- the pure core: pinning -----------------------------------------------------------------


def test_a_pinned_models_replica_goes_only_to_its_pinned_nodes():
    spread = ModelSpread(pinned={7: frozenset({"c"})})
    decisions, failures = place([replica(1)], fleet("a", "b", "c", models=spread), PluginSettings(), SAME_TENANT_ONLY)
    assert not failures and decisions[0].node_id == "c"  # ties would have said "a"
    # another service's model is not pinned: anywhere (ties: node id)
    decisions, _ = place(
        [replica(2, service=8)], fleet("a", "b", "c", models=spread), PluginSettings(), SAME_TENANT_ONLY
    )
    assert decisions[0].node_id == "a"


def test_a_pinned_replica_waits_when_its_nodes_are_full_and_never_spills_over():
    spread = ModelSpread(pinned={7: frozenset({"c", "gone"})})  # "gone": not in the snapshot
    nodes = fleet("a", "b", models=spread) + [node("c", 1, models=spread)]
    decisions, failures = place([replica(1, gpus=2)], nodes, PluginSettings(), SAME_TENANT_ONLY)
    assert not decisions
    assert failures[0].removed == {"capacity": 1, "model_pinned": 2}
    assert rejections(replica(1, gpus=2), nodes, PluginSettings(), SAME_TENANT_ONLY) == [
        {"node_id": "a", "filter": "model_pinned"},
        {"node_id": "b", "filter": "model_pinned"},
        {"node_id": "c", "filter": "capacity"},
    ]


def test_pinning_binds_replicas_only_a_task_that_is_no_replica_ignores_it():
    spread = ModelSpread(pinned={7: frozenset({"c"})})
    decisions, _ = place(
        [task(1), task(2, kind="training")], fleet("a", "c", models=spread), PluginSettings(), SAME_TENANT_ONLY
    )
    assert {d.node_id for d in decisions} <= {"a", "c"} and len(decisions) == 2


# --- the pure core: the model-cache score ---------------------------------------------------


def test_the_model_cache_score_is_higher_where_the_model_is_held():
    spread = ModelSpread(cached={7: frozenset({"b"})})
    a, b = fleet("a", "b", models=spread)
    assert score_model_cache(b, replica(1)) == MODEL_CACHED > score_model_cache(a, replica(1)) == NEUTRAL
    # another service's model, and a task that is no replica: neutral everywhere
    assert score_model_cache(b, replica(1, service=8)) == score_model_cache(b, task(2)) == NEUTRAL


def test_the_node_that_holds_the_model_wins_over_an_equal_one_but_not_over_capacity():
    spread = ModelSpread(cached={7: frozenset({"b"})})
    decisions, _ = place_on([replica(1)], fleet("a", "b", models=spread))
    assert decisions[0].node_id == "b"  # ties would have said "a"
    decisions, _ = place_on([replica(1, gpus=2)], [node("a", 8, models=spread), node("b", 1, models=spread)])
    assert decisions[0].node_id == "a"  # b holds the model but lacks the cards
    # disabled: node id again
    decisions, _ = place_on([replica(1)], fleet("a", "b", models=spread), PluginSettings(enabled=frozenset()))
    assert decisions[0].node_id == "a"


# --- the pure core: the inference cap -------------------------------------------------------


def test_a_node_at_the_inference_cap_takes_no_replica_but_still_takes_training():
    nodes = [node("a", 8, inference_replicas=8, ports_free=992), node("b", 8, inference_replicas=7, ports_free=993)]
    settings = PluginSettings(inference_cap=8)
    decisions, failures = place([replica(1), replica(2, service=8)], nodes, settings, SAME_TENANT_ONLY)
    # b takes one more (7 -> 8) and is then full too
    assert [d.node_id for d in decisions] == ["b"]
    assert failures[0].removed == {"inference_cap": 2}
    decisions, failures = place([task(3, kind="training"), task(4)], nodes, settings, SAME_TENANT_ONLY)
    assert not failures and {d.node_id for d in decisions} <= {"a", "b"}


def test_the_cap_counts_the_replicas_the_same_cycle_placed():
    nodes = [node("a", 8, ports_free=1000), node("b", 8, ports_free=1000)]
    settings = PluginSettings(layout="binpack", inference_cap=2, enabled=frozenset())
    queue = [replica(i, service=i) for i in range(1, 6)]
    decisions, failures = place(queue, nodes, settings, SAME_TENANT_ONLY)
    assert sorted(d.node_id for d in decisions) == ["a", "a", "b", "b"]
    assert [f.removed for f in failures] == [{"inference_cap": 2}]


def test_a_cap_of_zero_is_no_cap():
    nodes = [node("a", 8, inference_replicas=500, ports_free=500)]
    decisions, _ = place([replica(1)], nodes, PluginSettings(inference_cap=0), SAME_TENANT_ONLY)
    assert decisions[0].node_id == "a"


def test_the_words_name_the_pinning_and_the_cap():
    assert model_words({"capacity": 1}, 8) == []
    assert model_words({"model_pinned": 1, "inference_cap": 2}, 8) == [
        "model pinned: 1 node is not among the nodes its model is pinned to",
        "inference cap: 2 nodes already run 8 inference replicas, the most a node may "
        "(HETEROFLOW_INFERENCE_CONTAINERS_PER_NODE)",
    ]
    assert model_words({"model_pinned": 3, "inference_cap": 1}, 4) == [
        "model pinned: 3 nodes are not among the nodes its model is pinned to",
        "inference cap: 1 node already runs 4 inference replicas, the most a node may "
        "(HETEROFLOW_INFERENCE_CONTAINERS_PER_NODE)",
    ]


# --- through the snapshot, the cycle and explain ------------------------------------------


@pytest.mark.django_db
def test_the_cycle_binds_a_pinned_models_replicas_on_its_nodes_and_explain_says_why(api, world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=8)
    pinned_to = make_node("n1", gpus=1)
    model = make_model(acme)
    model.nodes.add(pinned_to)
    service = make_service(acme, model, replicas=2)
    run_cycle()
    placed = Task.objects.filter(group=service.group, status="scheduled")
    assert list(placed.values_list("node_id", flat=True)) == ["n1"]  # n0 has room, but not the model
    waiting = Task.objects.get(group=service.group, status="pending")
    assert waiting.schedule_reason["removed_by"] == {"capacity": 1, "model_pinned": 1}
    answer = api.get(f"/api/v1/tasks/{waiting.pk}/explain", **bearer(world.keys["acme-viewer"])).json()
    reason = answer["now"]["reason"]
    assert {"node_id": "n0", "filter": "model_pinned"} in reason["nodes"]
    assert "model pinned: 1 node is not among the nodes its model is pinned to" in reason["message"]
    assert ledger_agrees()


@pytest.mark.django_db
def test_the_snapshot_reads_pins_cached_nodes_and_replica_counts(world):
    acme, other = world.tenants["acme"], world.tenants["beta"]
    make_node("by-scan", discovered_models=[{"name": "qwen3-8b", "path": "/m/q", "size_bytes": 1, "format": "gguf"}])
    make_node("by-label", labels={CACHED_MODELS_LABEL: "/models/qwen3-8b/"})
    make_node("theirs", tenant=other, labels={CACHED_MODELS_LABEL: "qwen3-8b"})  # not a node acme may use
    busy = make_node("busy")
    model = make_model(acme)
    model.nodes.add(busy)
    service = make_service(acme, model, replicas=1)
    make_service(acme, make_model(acme, name="llama"), replicas=1, name="running", status="running", node=busy)
    make_task_holding(busy, acme, "running")  # a job: not an inference replica
    nodes = {n.id: n for n in load_nodes()}
    spread = nodes["busy"].models
    assert all(n.models is spread for n in nodes.values())
    assert spread.pinned == {service.pk: frozenset({"busy"})}
    assert spread.cached == {service.pk: frozenset({"by-scan", "by-label"})}
    assert nodes["busy"].inference_replicas == 1 and nodes["by-scan"].inference_replicas == 0


@pytest.mark.django_db
@override_settings(HETEROFLOW_INFERENCE_CONTAINERS_PER_NODE=1)
def test_the_cycle_keeps_a_full_node_for_training_and_off_for_replicas(api, world):
    acme = world.tenants["acme"]
    full = make_node("n0", gpus=8)
    make_service(acme, make_model(acme, name="llama"), replicas=1, name="running", status="running", node=full)
    service = make_service(acme, replicas=1)
    training = make_task(acme, kind="training", gpu_required=1)
    result = run_cycle()
    assert training.pk in result.bound
    (waiting,) = Task.objects.filter(group=service.group)
    assert waiting.status == "pending" and result.failed[waiting.pk]["removed_by"] == {"inference_cap": 1}
    answer = api.get(f"/api/v1/tasks/{waiting.pk}/explain", **bearer(world.keys["acme-viewer"])).json()
    reason = answer["now"]["reason"]
    assert reason["nodes"] == [{"node_id": "n0", "filter": "inference_cap"}]
    assert reason["message"] == (
        "inference cap: 1 node already runs 1 inference replica, the most a node may "
        "(HETEROFLOW_INFERENCE_CONTAINERS_PER_NODE)"
    )


def snapshot_queries(count):
    with CaptureQueriesContext(connection) as captured:
        nodes = load_nodes()
    assert len(nodes) == count
    return len(captured.captured_queries)


@pytest.mark.django_db
def test_the_snapshot_reads_the_model_distribution_in_queries_that_do_not_grow_with_the_fleet(world):
    acme = world.tenants["acme"]
    model = make_model(acme)
    make_service(acme, model, replicas=2)

    def add_nodes(first, count):
        for i in range(first, first + count):
            made = make_node(f"n{i:03}", gpus=1, labels={CACHED_MODELS_LABEL: "qwen3-8b"})
            if i % 2:
                model.nodes.add(made)

    add_nodes(0, 2)
    few = snapshot_queries(2)
    add_nodes(2, 20)
    assert snapshot_queries(22) == few
    # and without a waiting replica, the cached nodes are not read at all
    Task.objects.filter(group__service__model=model).update(status="cancelled")
    assert snapshot_queries(22) == few - 1
