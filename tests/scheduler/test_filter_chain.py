"""The placement chain is data (core.filters.FILTERS): placement, its explanation, `fits` and
preemption planning all run the same filters, so a filter added to the chain is seen by
every one of them, and they cannot disagree about a node."""

import itertools
import json

import pytest

from apps.scheduler import core, nvlink
from apps.scheduler.core import (
    GpuSnap,
    NodeSnap,
    Occupant,
    PluginSettings,
    TaskReq,
    filters,
    fits,
    occupants_by_node,
    place,
    plan_preemption,
    preemption,
)

SAME_TENANT_ONLY = lambda a, b: a == b  # noqa: E731


def snap(id, cards=2, rack="", status="online", **kw):
    return NodeSnap(
        id=id,
        status=status,
        executable=True,
        rack=rack,
        gpus=[GpuSnap(index, "nvidia", 81920) for index in range(cards)],
        **kw,
    )


def odd_rack(ask, fleet):
    """A test-only filter, written as a new one would be: one function..."""
    nodes = fleet.nodes
    return lambda position: "odd_rack" if nodes[position].rack == "odd" else None


def odd_rack_once_per_cycle(ask, fleet):
    """The same rule in the other form: a verdict per node, computed once per cycle."""
    return fleet.verdicts("odd_rack", lambda node: "odd_rack" if node.rack == "odd" else None)


@pytest.fixture(params=[odd_rack, odd_rack_once_per_cycle])
def chain_with_odd_rack(request, monkeypatch):
    # ...and one line in the chain
    monkeypatch.setattr(filters, "FILTERS", (*filters.FILTERS, request.param))


def test_a_filter_added_to_the_chain_is_seen_by_placement_explain_fits_and_preemption(chain_with_odd_rack):
    odd, even = snap("a-odd", rack="odd"), snap("b-even", rack="even")
    # placement: the filtered node is never chosen, though it wins the tie on id
    decisions, _ = place([TaskReq(1, 1, 1)], [odd, even], PluginSettings(), SAME_TENANT_ONLY)
    assert [d.node_id for d in decisions] == ["b-even"]
    # explain: counted under its reason, after the built-in ones
    _, failures = place(
        [TaskReq(2, 1, 2)],
        [snap("a-odd", rack="odd"), snap("small", cards=1), snap("down", status="offline")],
        PluginSettings(),
        SAME_TENANT_ONLY,
    )
    assert failures[0].code == "InsufficientResources"
    assert list(failures[0].as_reason()["removed_by"].items()) == [("unavailable", 1), ("capacity", 1), ("odd_rack", 1)]
    # fits
    assert not fits(snap("a-odd", rack="odd"), TaskReq(3, 1, 1), PluginSettings(), SAME_TENANT_ONLY)
    assert fits(snap("b-even", rack="even"), TaskReq(3, 1, 1), PluginSettings(), SAME_TENANT_ONLY)
    # preemption: a victim on the filtered node would free cards the task may not use
    busy_odd, busy_even = snap("a-odd", cards=1, rack="odd"), snap("b-even", cards=1, rack="even")
    for node, task_id in ((busy_odd, 101), (busy_even, 102)):
        node.gpus[0].holders.append((task_id, 1, None))
    occupants = [
        Occupant(101, "a-odd", "running", "job", True, 10, 0.0),
        Occupant(102, "b-even", "running", "job", True, 20, 0.0),
    ]
    plan = plan_preemption(
        TaskReq(4, 1, 1, priority=50),
        [busy_odd, busy_even],
        occupants_by_node(occupants),
        PluginSettings(),
        SAME_TENANT_ONLY,
    )
    assert (plan.node_id, plan.victims) == ("b-even", [102])  # not the cheaper victim on the odd rack


def test_the_built_in_chain_and_its_order():
    """A node is counted under the first filter that removes it: the order is part of the explanation."""
    assert core.FILTERS == (
        core.node_available,
        core.tenant_visible,
        core.runtime_mode,  # what the node is: its exec_mode, its labels
        core.node_affinity,
        core.label_anti_affinity,
        core.model_pinned,  # a replica's model pinned to other nodes: what the node is, too
        core.under_load,
        core.same_service,  # per node: the cycle's own placements move the answer
        core.inference_cap,  # before ports: the smaller limit says why first
        core.host_port,
        core.reserved_cards,  # before capacity: a card held for a group is why, not a lack of cards
        core.gpu_capacity,
        core.rdma_link,
        core.nvlink_domain,
    )


def test_giving_cards_back_keeps_every_other_field_of_the_node():
    node = snap(
        "n",
        cards=2,
        rack="k1",
        tenant_id=3,
        labels={"rdma": "true"},
        cpu_used=12.0,
        memory_used=34.0,
        ports_free=7,
        region="r1",
        zone="z1",
    )
    node.gpus[0].holders.append((101, 3, None))
    node.gpus[1].holders.append((102, 3, None))
    freed = preemption.without_tasks(node, {101})
    assert freed.ports_free == 7  # the positional rebuild used to drop it
    assert [gpu.holders for gpu in freed.gpus] == [[], [(102, 3, None)]]
    assert [gpu.holders for gpu in node.gpus] == [[(101, 3, None)], [(102, 3, None)]]  # the node itself is untouched
    assert {**vars_of(freed), "gpus": None} == {**vars_of(node), "gpus": None}


def vars_of(node):
    return {field: getattr(node, field) for field in NodeSnap.__dataclass_fields__}


def test_an_inference_task_that_no_node_could_hold_is_explained_filter_by_filter():
    """No node has four free cards; the node without a host port is counted under ports,
    as it is for a task that fits somewhere (one chain, no shortcut with its own rules)."""
    no_port, roomy = snap("a", ports_free=0), snap("b", ports_free=3)
    _, failures = place([TaskReq(1, 1, 4, kind="inference")], [no_port, roomy], PluginSettings(), SAME_TENANT_ONLY)
    assert failures[0].removed == {"capacity": 1, "ports": 1}


TOPOLOGY = json.dumps({"nvlink": [[0, 1], [2, 3]], "numa": {"0": 0, "1": 0, "2": 1, "3": 1}})
NODES = {
    "plain": {},
    "offline": {"status": "offline"},
    "dedicated": {"tenant_id": 2},
    "hot": {"cpu_used": 95.0},
    "no-port": {"ports_free": 0},
    "no-rdma": {"labels": {"rdma": "false"}},
    "linked": {"labels": {nvlink.TOPOLOGY_LABEL: TOPOLOGY}},
    "half-taken": {"taken": [(0, None), (2, None)]},
    "shared": {"taken": [(0, 30000)], "holder_tenant": 2},
    "ascend": {"vendor": "ascend"},
}
TASKS = [
    {"gpu_required": 1},
    {"gpu_required": 2},
    {"gpu_required": 4},
    {"gpu_required": 0},
    {"gpu_required": 0, "gpu_memory_mb": 40000},
    {"gpu_required": 2, "labels": {"nvlink": "required"}},
    {"gpu_required": 1, "labels": {"rdma": "required"}},
    {"gpu_required": 1, "kind": "inference"},
    {"gpu_required": 1, "gpu_type": "ascend"},
    {"gpu_required": 1, "gpu_memory_mb": 90000},
]


def built(kind):
    spec = dict(NODES[kind])
    taken, holder, vendor = spec.pop("taken", []), spec.pop("holder_tenant", 1), spec.pop("vendor", "nvidia")
    node = NodeSnap(
        id=kind,
        status=spec.pop("status", "online"),
        executable=True,
        gpus=[GpuSnap(index, vendor, 81920) for index in range(4)],
        **spec,
    )
    for index, memory in taken:
        node.gpus[index].holders.append((900 + index, holder, memory))
    return node


@pytest.mark.parametrize("kind,shape", list(itertools.product(NODES, range(len(TASKS)))))
def test_fits_and_placement_agree_on_every_node(kind, shape):
    task = TaskReq(id=1, tenant_id=1, **TASKS[shape])
    decisions, failures = place([task], [built(kind)], PluginSettings(), SAME_TENANT_ONLY)
    assert fits(built(kind), task, PluginSettings(), SAME_TENANT_ONLY) == bool(decisions)
