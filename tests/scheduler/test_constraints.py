"""Hard placement constraints in the pure core (docs/scheduler.md#hard-constraints): the
runtime a task accepts against the node's exec_mode, node affinity and anti-affinity by
label, and a service's replicas kept off each other's nodes; in placement, groups,
preemption planning and the explanation alike. And a node brought to what bind found,
for the preemption a refused decision gets."""

from dataclasses import replace

from apps.scheduler.core import (
    BindFound,
    Occupant,
    PluginSettings,
    as_bind_found,
    constraint_words,
    fits,
    group_reach,
    hold_for_group,
    occupants_by_node,
    place,
    place_group,
    place_queue,
    plan_preemption,
    rejections,
)
from apps.scheduler.core.fleet import FleetView
from tests.scheduler.snapshots import SAME_TENANT_ONLY, group, node, task

SETTINGS = PluginSettings()


def placed_on(tasks, nodes, **kw) -> dict[int, str]:
    decisions, _ = place(tasks, nodes, SETTINGS, SAME_TENANT_ONLY, **kw)
    return {d.task_id: d.node_id for d in decisions}


def failure_of(one, nodes, **kw):
    _, failures = place([one], nodes, SETTINGS, SAME_TENANT_ONLY, **kw)
    assert len(failures) == 1
    return failures[0]


# --- runtime --------------------------------------------------------------------------------


def fleet_of_runtimes():
    return [node("a-docker", 2), node("b-process", 2, exec_mode="process"), node("c-docker", 2)]


def test_a_process_task_goes_only_where_processes_run_and_a_container_task_never_there():
    assert placed_on([task(1, runtime="process")], fleet_of_runtimes()) == {1: "b-process"}
    many = [task(n, runtime="container") for n in range(1, 5)]
    assert set(placed_on(many, fleet_of_runtimes()).values()) == {"a-docker", "c-docker"}
    # auto, the default, goes anywhere: today's behaviour
    assert len(placed_on([task(n) for n in range(1, 7)], fleet_of_runtimes())) == 6


def test_a_runtime_no_node_has_is_explained():
    docker_only = [node("a", 2), node("b", 2)]
    failure = failure_of(task(1, runtime="process"), docker_only)
    assert (failure.code, failure.removed) == ("InsufficientResources", {"runtime": 2})
    assert constraint_words(task(1, runtime="process"), docker_only, failure.removed) == [
        "runtime process: 2 nodes run tasks only in containers; no schedulable node runs processes "
        "(an agent with the process runtime)"
    ]
    processes = [node("p", 2, exec_mode="process")]
    container = failure_of(task(2, runtime="container"), processes)
    assert constraint_words(task(2, runtime="container"), processes, container.removed) == [
        "runtime container: 1 node run only processes, no containers"
    ]


# --- affinity and anti-affinity by label ------------------------------------------------------


def labelled_fleet():
    return [
        node("a", 2, labels={"gpu-pool": "a100", "zone": "z1"}),
        node("b", 2, labels={"gpu-pool": "a100", "zone": "z2"}),
        node("c", 2, labels={"gpu-pool": "h100", "zone": "z1", "maintenance": "soon"}),
        node("d", 2, labels={"rdma": True}),  # a label whose JSON value is not text
    ]


def test_affinity_takes_only_nodes_with_every_label():
    wanted = task(1, affinity_labels={"gpu-pool": "a100", "zone": "z2"})
    assert placed_on([wanted], labelled_fleet()) == {1: "b"}
    assert placed_on([task(2, affinity_labels={"rdma": "True"})], labelled_fleet()) == {2: "d"}
    crowd = [task(n, gpus=2, affinity_labels={"gpu-pool": "a100"}) for n in (3, 4, 5)]
    decisions, failures = place(crowd, labelled_fleet(), SETTINGS, SAME_TENANT_ONLY)
    assert {d.node_id for d in decisions} == {"a", "b"}
    # the third: a and b are full, c and d lack the label; each node counted under its filter
    assert failures[0].removed == {"capacity": 2, "affinity": 2}


def test_a_label_no_node_has_is_named_and_each_node_gets_its_filter():
    wanted = task(1, affinity_labels={"gpu-pool": "b200", "zone": "z1"})
    fleet = labelled_fleet()
    failure = failure_of(wanted, fleet)
    assert failure.removed == {"affinity": 4}
    assert constraint_words(wanted, fleet, failure.removed) == [
        "affinity: no schedulable node has the label gpu-pool=b200"
    ]
    every_label_somewhere = task(2, affinity_labels={"gpu-pool": "h100", "zone": "z2"})
    failure = failure_of(every_label_somewhere, fleet)
    assert constraint_words(every_label_somewhere, fleet, failure.removed) == [
        "affinity: 4 nodes lack at least one of gpu-pool=h100, zone=z2"
    ]
    fleet[0] = replace(fleet[0], status="offline")
    assert rejections(wanted, fleet, SETTINGS, SAME_TENANT_ONLY) == [
        {"node_id": "a", "filter": "unavailable"},
        {"node_id": "b", "filter": "affinity"},
        {"node_id": "c", "filter": "affinity"},
        {"node_id": "d", "filter": "affinity"},
    ]
    assert len(rejections(wanted, fleet, SETTINGS, SAME_TENANT_ONLY, limit=2)) == 2


def test_anti_affinity_never_takes_a_node_with_any_of_the_labels():
    avoid = {"maintenance": "soon", "zone": "z2"}
    many = [task(n, anti_affinity_labels=avoid) for n in range(1, 6)]
    decisions, failures = place(many, labelled_fleet(), SETTINGS, SAME_TENANT_ONLY)
    assert {d.node_id for d in decisions} == {"a", "d"}
    assert failures[0].removed == {"capacity": 2, "anti_affinity": 2}
    assert constraint_words(many[4], labelled_fleet(), failures[0].removed) == [
        "anti-affinity: 2 nodes carry a label it avoids (maintenance=soon, zone=z2)"
    ]
    assert not fits(labelled_fleet()[2], many[0], SETTINGS, SAME_TENANT_ONLY)
    assert fits(labelled_fleet()[0], many[0], SETTINGS, SAME_TENANT_ONLY)


# --- a service's replicas ---------------------------------------------------------------------


def replica(id, apart=True, **kw):
    return task(id, replica_of=7, same_service_apart=apart, **kw)


def test_replicas_kept_apart_never_share_a_node_in_a_cycle_or_with_those_bound():
    fleet = [node("a", 4), node("b", 4)]
    decisions, failures = place([replica(1), replica(2), replica(3)], fleet, SETTINGS, SAME_TENANT_ONLY)
    assert sorted(d.node_id for d in decisions) == ["a", "b"]
    assert failures[0].task_id == 3 and failures[0].removed == {"same_service": 2}
    # the soft spread alone stacks the third where a service has more replicas than nodes
    soft = placed_on([replica(n, apart=False) for n in (1, 2, 3)], [node("a", 4), node("b", 4)])
    assert len(soft) == 3
    # one bound on a already (siblings, as the shell reads them): the next goes to b only
    assert placed_on([replica(4)], [node("a", 4), node("b", 4)], siblings={7: {"a": 1}}) == {4: "b"}
    assert placed_on([replica(5)], [node("a", 4)], siblings={8: {"a": 1}}) == {5: "a"}  # another service's


def test_the_siblings_placement_leaves_are_what_preemption_plans_with():
    placement = place_queue([replica(1)], [node("a", 1), node("b", 1)], SETTINGS, SAME_TENANT_ONLY, siblings={7: {}})
    assert placement.siblings == {7: {placement.decisions[0].node_id: 1}}


# --- groups --------------------------------------------------------------------------------------


def test_a_groups_workers_take_only_nodes_its_constraints_allow_and_its_reach_says_so():
    fleet = [node("a", 8, labels={"fabric": "ib"}), node("b", 8), node("c", 8, labels={"fabric": "ib"})]
    wanting = group(1, workers=2, gpus=8, affinity_labels={"fabric": "ib"})
    decision = place_group(wanting, FleetView(fleet, SETTINGS, SAME_TENANT_ONLY))
    assert sorted(d.node_id for d in decision.decisions) == ["a", "c"]
    too_big = group(2, workers=3, gpus=8, affinity_labels={"fabric": "ib"})
    failure = place_group(
        too_big, FleetView([node("a", 8, labels={"fabric": "ib"}), node("b", 8)], SETTINGS, SAME_TENANT_ONLY)
    )
    assert failure.removed == {"affinity": 1} and (failure.placeable, failure.reach) == (1, 1)
    processes = group(3, workers=1, gpus=2, runtime="process")
    fleet_view = FleetView([node("a", 8), node("p", 8, exec_mode="process")], SETTINGS, SAME_TENANT_ONLY)
    assert [d.node_id for d in place_group(processes, fleet_view).decisions] == ["p"]
    assert [fleet_view.nodes[position].id for position, _ in group_reach(processes, fleet_view)] == ["p"]


def test_a_reserving_group_holds_nothing_on_nodes_it_could_not_use():
    busy = [node("a", 8, labels={"fabric": "ib"}), node("b", 8)]
    for card in busy[0].gpus[:4]:
        card.holders.append((900, 1, None))
    fleet = FleetView(busy, SETTINGS, SAME_TENANT_ONLY)
    wanting = group(1, workers=1, gpus=8, affinity_labels={"fabric": "ib"})
    held = hold_for_group(wanting, fleet)
    assert held.wanted == {"a": 8} and held.held == {"a": [4, 5, 6, 7]}  # never b's free cards


# --- preemption planning --------------------------------------------------------------------------


def busy(id, **kw):
    snap = node(id, 1, **kw)
    snap.gpus[0].holders.append((100 + len(id), 1, None))
    return snap


def test_preemption_plans_only_where_the_constraints_allow():
    fleet = [busy("a"), busy("bb", labels={"gpu-pool": "a100"})]
    occupants = occupants_by_node(
        [Occupant(101, "a", "running", "job", True, 10, 0.0), Occupant(102, "bb", "running", "job", True, 40, 0.0)]
    )
    plain = plan_preemption(task(1, priority=90), fleet, occupants, SETTINGS, SAME_TENANT_ONLY)
    assert (plain.node_id, plain.victims) == ("a", [101])  # the cheaper victim
    wanting = plan_preemption(
        task(1, priority=90, affinity_labels={"gpu-pool": "a100"}), fleet, occupants, SETTINGS, SAME_TENANT_ONLY
    )
    assert (wanting.node_id, wanting.victims) == ("bb", [102])
    apart = plan_preemption(replica(1, priority=90), fleet, occupants, SETTINGS, SAME_TENANT_ONLY, siblings={"a": 1})
    assert (apart.node_id, apart.victims) == ("bb", [102])
    assert (
        plan_preemption(task(1, priority=90, runtime="process"), fleet, occupants, SETTINGS, SAME_TENANT_ONLY) is None
    )


# --- a node as bind found it ------------------------------------------------------------------------


def test_a_node_bind_found_gone_takes_nothing_more():
    snap = node("a", 2)
    gone = as_bind_found(snap, BindFound(False, frozenset(), {}), {1})
    assert not fits(gone, task(2), SETTINGS, SAME_TENANT_ONLY)
    assert snap.executable  # the snapshot's own node is left as it was


def test_a_node_bind_found_changed_has_the_racers_holders_not_the_refused_ones():
    snap = node("a", 3)
    snap.gpus[0].holders.append((1, 1, None))  # the refused decision's, put there by the cycle
    snap.gpus[2].holders.append((5, 1, None))  # bound before the cycle
    found = BindFound(True, frozenset({0, 1}), {0: ((77, 2, None),), 2: ((5, 1, None),)})
    seen = as_bind_found(snap, found, {1})
    assert [gpu.holders for gpu in seen.gpus] == [[(77, 2, None)], [], [(5, 1, None)]]
    assert [gpu.cordoned for gpu in seen.gpus] == [False, False, True]  # card 2: no longer usable
    assert snap.gpus[0].holders == [(1, 1, None)] and not snap.gpus[2].cordoned  # copies, not the snapshot's
    assert fits(seen, task(2), SETTINGS, SAME_TENANT_ONLY) and not fits(
        seen, task(3, gpus=2), SETTINGS, SAME_TENANT_ONLY
    )
