"""An inference service's replicas (members of a TaskGroup placed as `replicas`) are
placed one by one by the single tasks' path, each with its host port, spread over nodes
by the `replica-spread` score; gang groups are placed whole as before."""

import pytest

from apps.scheduler.core import PluginSettings, place, place_queue, score_replica_spread
from apps.scheduler.models import PluginConfig
from apps.scheduler.services import (
    group_window,
    next_batch,
    queue_state,
    replicas_on_nodes,
    run_cycle,
    waiting_group,
)
from apps.tasks.models import Task, TaskGroup
from apps.tasks.services import agent_report
from tests.factories import make_group, make_node, make_replica_group, make_task
from tests.headers import bearer
from tests.scheduler.ledger import ledger_agrees
from tests.scheduler.snapshots import SAME_TENANT_ONLY, node, task

# --- the pure core ------------------------------------------------------------------------


@pytest.mark.parametrize("siblings,expected", [(0, 100.0), (1, 50.0), (2, 100 / 3), (9, 10.0)])
def test_the_replica_spread_score_falls_with_each_sibling_on_the_node(siblings, expected):
    assert score_replica_spread(siblings) == pytest.approx(expected)


def replica(id, service=7, **kw):
    return task(id=id, kind="inference", replica_of=service, **kw)


def test_replicas_of_one_service_go_to_different_nodes_in_one_cycle():
    nodes = [node("a", 8), node("b", 8), node("c", 8)]
    decisions, failures = place(
        [replica(1), replica(2), replica(3)], nodes, PluginSettings(layout="binpack"), SAME_TENANT_ONLY
    )
    # binpack alone would stack them on one node; the spread keeps them apart
    assert not failures and sorted(d.node_id for d in decisions) == ["a", "b", "c"]


def test_a_node_running_a_sibling_already_is_avoided_and_other_services_are_not():
    nodes = [node("a", 8), node("b", 8)]
    siblings = {7: {"a": 1}}
    decisions, _ = place([replica(1)], nodes, PluginSettings(), SAME_TENANT_ONLY, siblings=siblings)
    assert decisions[0].node_id == "b"
    # another service's replica does not care where service 7 runs (ties: node id)
    decisions, _ = place([replica(2, service=8)], nodes, PluginSettings(), SAME_TENANT_ONLY, siblings=siblings)
    assert decisions[0].node_id == "a"


def test_the_spread_is_soft_more_replicas_than_nodes_are_all_placed():
    decisions, failures = place(
        [replica(i) for i in range(1, 5)], [node("a", 8), node("b", 8)], PluginSettings(), SAME_TENANT_ONLY
    )
    assert not failures
    assert sorted(d.node_id for d in decisions) == ["a", "a", "b", "b"]  # two each, not four on one


def test_the_only_node_that_fits_takes_a_replica_even_with_a_sibling_on_it():
    full = node("b", 1)
    full.gpus[0].holders.append((99, 1, None))
    decisions, _ = place([replica(1)], [node("a", 8), full], PluginSettings(), SAME_TENANT_ONLY, siblings={7: {"a": 3}})
    assert [d.node_id for d in decisions] == ["a"]


def test_the_spread_disabled_or_weighted_changes_the_choice():
    nodes = [node("a", 8), node("b", 8)]
    off = PluginSettings(layout="binpack", enabled=frozenset({"topology", "rdma", "nvlink"}))
    decisions, _ = place([replica(1), replica(2)], nodes, off, SAME_TENANT_ONLY)
    assert [d.node_id for d in decisions] == ["a", "a"]  # binpack stacks them when the spread is off
    heavy = PluginSettings(layout="binpack", weights=PluginSettings().weights | {"replica-spread": 3.0})
    decisions, _ = place([replica(1), replica(2)], nodes, heavy, SAME_TENANT_ONLY)
    assert sorted(d.node_id for d in decisions) == ["a", "b"]


def test_a_single_task_scores_exactly_as_before():
    def fleet():
        return [node("a", 8), node("b", 8, cpu_used=50.0)]

    plain, _ = place([task(1)], fleet(), PluginSettings(), SAME_TENANT_ONLY)
    off, _ = place(
        [task(1)], fleet(), PluginSettings(enabled=frozenset({"topology", "rdma", "nvlink"})), SAME_TENANT_ONLY
    )
    assert (plain[0].node_id, plain[0].score) == (off[0].node_id, off[0].score)


def test_place_queue_leaves_the_siblings_it_was_given_alone():
    siblings = {7: {"a": 1}}
    place_queue([replica(1)], [node("a", 8), node("b", 8)], PluginSettings(), SAME_TENANT_ONLY, siblings=siblings)
    assert siblings == {7: {"a": 1}}


# --- the cycle ----------------------------------------------------------------------------


def members(group) -> list[Task]:
    return list(Task.objects.filter(group=group).order_by("rank"))


@pytest.mark.django_db
def test_replicas_are_placed_one_by_one_each_with_a_host_port(world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=1)
    service = make_replica_group(acme, replicas=3, gpus=1)
    result = run_cycle()
    # one card for three replicas: the first is placed, the others wait (a gang would wait whole)
    assert result.groups_bound == [] and result.groups_failed == {}
    replicas = members(service)
    assert [t.status for t in replicas] == ["scheduled", "pending", "pending"]
    assert replicas[0].node_id == "n0" and 8000 <= replicas[0].host_port < 9000
    assert replicas[1].schedule_reason["code"] == "InsufficientResources"
    assert "group" not in replicas[1].schedule_reason  # explained as a single task
    service.refresh_from_db()
    assert (service.attempts, service.schedule_reason, service.reservation) == (0, {}, {})
    make_node("n1", gpus=1)
    assert run_cycle().bound == [replicas[1].pk]
    assert ledger_agrees()


@pytest.mark.django_db
def test_replicas_spread_over_nodes_across_cycles(world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=4)
    make_node("n1", gpus=4)
    PluginConfig.objects.create(name="binpack", enabled=True)  # packing would stack them
    PluginConfig.objects.create(name="spread", enabled=False)
    first = make_replica_group(acme, replicas=1, name="svc-a")
    run_cycle()
    (placed,) = members(first)
    assert agent_report(placed, from_status="scheduled", to_status="running")
    # a second replica of the same service, added later (a scale-up), avoids its sibling's node
    second = Task.objects.create(
        tenant=acme, name="svc-a-1", image="x", kind="inference", group=first, rank=1, gpu_required=1
    )
    other = make_replica_group(acme, replicas=1, name="svc-b")
    assert replicas_on_nodes(next_batch()) == {first.pk: {placed.node_id: 1}, other.pk: {}}
    run_cycle()
    second.refresh_from_db()
    (theirs,) = members(other)
    assert second.node_id != placed.node_id
    assert theirs.node_id == placed.node_id  # another service packs where binpack says


@pytest.mark.django_db
def test_no_query_for_siblings_without_replicas(world, django_assert_num_queries):
    make_task(world.tenants["acme"])
    batch = next_batch()
    with django_assert_num_queries(0):
        assert replicas_on_nodes(batch) == {}


@pytest.mark.django_db
def test_gang_groups_are_placed_whole_and_replicas_never_by_the_gang_path(world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=8)
    gang = make_group(acme, workers=2, gpus=2)
    service = make_replica_group(acme, replicas=2, gpus=1)
    single = make_task(acme, gpu_required=1)
    assert {t.id for t in next_batch()} == {single.pk, *(t.pk for t in members(service))}
    assert [g.id for g, _ in group_window().entries] == [gang.pk]
    assert waiting_group(service) is None and waiting_group(gang) is not None
    result = run_cycle()
    assert result.groups_bound == [gang.pk]
    assert all(t.status == "scheduled" for t in Task.objects.all())
    gang.refresh_from_db()
    assert gang.attempts == 1 and gang.network
    assert TaskGroup.objects.get(pk=service.pk).attempts == 0
    assert ledger_agrees()


@pytest.mark.django_db
def test_the_queue_state_counts_replicas_as_singles_and_only_gangs_as_groups(world):
    acme = world.tenants["acme"]
    make_replica_group(acme, replicas=3)
    assert queue_state(2) == (True, False)  # three pending singles, more than a batch of 2; no gang
    assert queue_state(3) == (False, False)
    make_group(acme, workers=2, gpus=1)
    assert queue_state(3) == (False, True)


@pytest.mark.django_db
def test_a_replica_with_no_port_left_waits_explained_and_its_sibling_is_placed(world, monkeypatch):
    from apps.scheduler import bind

    monkeypatch.setattr(bind, "INFERENCE_PORTS", range(8000, 8001))  # one port per node
    acme = world.tenants["acme"]
    make_node("n0", gpus=4)
    service = make_replica_group(acme, replicas=2)
    run_cycle()
    first, second = members(service)
    assert (first.status, first.host_port) == ("scheduled", 8000)
    assert second.status == "pending" and second.schedule_reason["removed_by"] == {"ports": 1}


@pytest.mark.django_db
def test_a_replicas_groups_explain_has_no_group_dry_run_and_shows_its_replicas_status(api, world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=1)
    service = make_replica_group(acme, replicas=2)
    run_cycle()
    answer = api.get(f"/api/v1/task-groups/{service.pk}/explain", **bearer(world.keys["acme-viewer"])).json()
    # one replica placed, one waiting for a card: scheduled (a gang would still be pending), no gang dry run
    assert (answer["status"], answer["now"], answer["reservation"]) == ("scheduled", None, {})
    listed = api.get("/api/v1/task-groups", {"status": "scheduled"}, **bearer(world.keys["acme-viewer"])).json()
    assert [(group["id"], group["placement"]) for group in listed["results"]] == [(service.pk, "replicas")]
