"""Task groups in the pure core: all or nothing, rack and zone preference, the strict
gpu_type, packing per strategy, the explanations."""

import json

from apps.nodes.choices import CORDON_LABEL
from apps.scheduler import nvlink
from apps.scheduler.core import GroupDecision, GroupFailure, PluginSettings, place_queue
from tests.scheduler.snapshots import SAME_TENANT_ONLY, gpus, group, node, task


def placed(queue, nodes, settings=None):
    return place_queue(queue, nodes, settings or PluginSettings(), SAME_TENANT_ONLY)


def layout(outcome: GroupDecision) -> list[tuple[str, list[int]]]:
    return [(d.node_id, d.gpu_indices) for d in outcome.decisions]


def test_a_group_that_fits_is_placed_whole_rank_by_rank():
    nodes = [node(f"n{i}") for i in range(4)]
    result = placed([group(workers=4, gpus=8)], nodes)
    assert result.group_failures == []
    [outcome] = result.groups
    assert [d.task_id for d in outcome.decisions] == [1000, 1001, 1002, 1003]
    assert sorted(d.node_id for d in outcome.decisions) == ["n0", "n1", "n2", "n3"]
    assert all(d.gpu_indices == list(range(8)) for d in outcome.decisions)
    # the cards are taken in the snapshot: nothing is left for a single task after it
    assert all(len(gpu.holders) == 1 for n in nodes for gpu in n.gpus)


def test_all_or_nothing_takes_no_card_when_one_worker_does_not_fit():
    nodes = [node("n0"), node("n1"), node("n2"), node("small", n=4)]
    result = placed([group(workers=4, gpus=8), task(id=1, gpus=4)], nodes)
    [failure] = result.group_failures
    assert result.groups == []
    assert failure.message == "not enough nodes of type nvidia in the tenant's reach: 3 of 4 workers"
    assert failure.as_reason() == {
        "code": "InsufficientResources",
        "message": failure.message,
        "removed_by": {"capacity": 1},
        # the small node could not take an 8-card worker even empty: 3 in the tenant's reach
        "workers": {"placeable": 3, "needed": 4, "reach": 3},
    }
    # nothing was held back: the single task behind it gets a node
    assert [d.task_id for d in result.decisions] == [1]
    assert sum(len(gpu.holders) for n in nodes for gpu in n.gpus) == 4


def test_strict_gpu_type_never_falls_back_to_another_vendor():
    nodes = [node("nv0"), node("asc0", gpus=gpus(8, vendor="ascend")), node("asc1", gpus=gpus(8, vendor="ascend"))]
    [failure] = placed([group(workers=2, gpus=8, gpu_type="nvidia")], nodes).group_failures
    assert failure.placeable == 1 and failure.removed == {"capacity": 2}
    [outcome] = placed([group(workers=2, gpus=8, gpu_type="ascend")], nodes).groups
    assert {d.node_id for d in outcome.decisions} == {"asc0", "asc1"}
    # mixed node: only its cards of the type count
    mixed = node("mixed", gpus=gpus(4) + [g for g in gpus(8, vendor="ascend")[4:]])
    [failure] = placed([group(workers=2, gpus=4, gpu_type="ascend")], [mixed]).group_failures
    assert failure.placeable == 1


def test_a_type_not_present_in_reach_says_so():
    theirs = node("theirs", gpus=gpus(8, vendor="ascend"), tenant_id=2)
    [failure] = placed([group(workers=1, gpu_type="ascend")], [node("nv0"), theirs]).group_failures
    assert (failure.code, failure.message) == ("GpuTypeNotPresent", "type ascend not present")
    assert failure.removed == {"tenant": 1, "capacity": 1}
    [failure] = placed([group(workers=1, gpu_type="")], [node("nv0")]).group_failures
    assert failure.code == "GpuTypeRequired"


def test_the_same_rack_is_preferred_then_the_same_zone():
    nodes = [
        node("a1", zone="za", rack="ra"),
        node("b1", zone="zb", rack="rb"),
        node("b2", zone="zb", rack="rb"),
        node("b3", zone="zb", rack="rc"),
        node("c1", zone="zc", rack="rd"),
    ]
    [outcome] = placed([group(workers=2, gpus=8)], nodes).groups
    assert {d.node_id for d in outcome.decisions} == {"b1", "b2"}  # one rack can hold the group
    assert outcome.score == 6
    nodes = [
        node("a1", zone="za", rack="ra"),
        node("b1", zone="zb", rack="rb"),
        node("b3", zone="zb", rack="rc"),
        node("c1", zone="zc", rack="rd"),
    ]
    [outcome] = placed([group(workers=2, gpus=8)], nodes).groups
    assert {d.node_id for d in outcome.decisions} == {"b1", "b3"}  # no rack can: the same zone
    assert outcome.score == 3 + 2
    # soft: no two nodes share anything, the group is placed anyway
    nodes = [node("a1", zone="za", rack="ra"), node("c1", zone="zc", rack="rd")]
    [outcome] = placed([group(workers=2, gpus=8)], nodes).groups
    assert outcome.score == 3 + 0


def test_tp_and_data_parallel_pack_a_node_first_and_pp_spreads():
    def fleet():
        return [node("n0"), node("n1"), node("n2"), node("n3")]

    for strategy in ("tp", "ddp", "fsdp", "deepspeed"):
        [outcome] = placed([group(workers=4, gpus=2, strategy=strategy)], fleet()).groups
        assert layout(outcome) == [("n0", [0, 1]), ("n0", [2, 3]), ("n0", [4, 5]), ("n0", [6, 7])], strategy
    [outcome] = placed([group(workers=4, gpus=2, strategy="pp")], fleet()).groups
    assert sorted(d.node_id for d in outcome.decisions) == ["n0", "n1", "n2", "n3"]
    # pp with more stages than nodes: a second round per node, ranks kept together per node
    [outcome] = placed([group(workers=6, gpus=2, strategy="pp")], fleet()).groups
    assert [d.node_id for d in outcome.decisions] == ["n0", "n0", "n1", "n1", "n2", "n3"]


def test_packing_several_nodes_uses_the_fewest():
    nodes = [node("half", gpus=gpus(8)[:4]), node("full0"), node("full1")]
    [outcome] = placed([group(workers=4, gpus=4, strategy="ddp")], nodes).groups
    assert [d.node_id for d in outcome.decisions] == ["full0", "full0", "full1", "full1"]


def test_each_worker_gets_an_nvlink_domain_inside_a_node():
    topology = json.dumps(
        {"nvlink": [[0, 1], [1, 2], [2, 3], [4, 5], [5, 6], [6, 7]], "numa": {str(i): i // 4 for i in range(8)}}
    )
    box = node("box", labels={nvlink.TOPOLOGY_LABEL: topology})
    [outcome] = placed([group(workers=2, gpus=4, strategy="tp")], [box]).groups
    assert layout(outcome) == [("box", [0, 1, 2, 3]), ("box", [4, 5, 6, 7])]


def test_the_chain_applies_to_each_worker():
    nodes = [
        node("down", status="offline"),
        node("loaded", cpu_used=99.0),
        node("ok"),
        node("cordoned", labels={CORDON_LABEL: "true"}),
    ]
    [failure] = placed([group(workers=2, gpus=8)], nodes).group_failures
    assert failure.removed == {"unavailable": 2, "load": 1}
    assert failure.placeable == 1


def test_a_group_behind_higher_priority_singles_sees_what_they_took():
    nodes = [node("n0"), node("n1")]
    result = placed([task(id=1, gpus=1, priority=90), group(workers=2, gpus=8, priority=50)], nodes)
    assert [d.task_id for d in result.decisions] == [1]
    assert isinstance(result.group_failures[0], GroupFailure)
    result = placed([group(workers=2, gpus=8, priority=90), task(id=1, gpus=1, priority=50)], [node("n0"), node("n1")])
    assert len(result.groups) == 1 and result.failures[0].task_id == 1
