"""NVLink domains: parsing, the spec's numbers, card choice, `nvlink: required`."""

import json

import pytest

from apps.scheduler import nvlink
from apps.scheduler.core import GpuSnap, NodeSnap, PluginSettings, TaskReq, place

# 8 cards: NVLink domains {0,1,2,3} and {4,5}, PCIe cards 6 and 7; NUMA 0 = 0-3, 1 = 4-7
TOPOLOGY = json.dumps(
    {
        "nvlink": [[0, 1], [1, 2], [2, 3], [4, 5]],
        "numa": {"0": 0, "1": 0, "2": 0, "3": 0, "4": 1, "5": 1, "6": 1, "7": 1},
    }
)


def topo():
    return nvlink.parse({nvlink.TOPOLOGY_LABEL: TOPOLOGY}, range(8))


def test_union_find_domains_and_single_card_domains():
    t = topo()
    assert {t.domain_of[i] for i in (0, 1, 2, 3)} == {0}
    assert t.domain_of[4] == t.domain_of[5] == 4
    assert t.domain_of[6] == 6 and t.domain_of[7] == 7
    assert nvlink.parse({}, range(8)) is None
    assert nvlink.parse({nvlink.TOPOLOGY_LABEL: "not json"}, range(8)) is None


@pytest.mark.parametrize(
    "free,count,expected",
    [
        (list(range(8)), 2, [4, 5]),  # the smallest domain that fits: keep the big one whole
        (list(range(8)), 4, [0, 1, 2, 3]),
        (list(range(8)), 1, [6]),  # a single PCIe card for a single-card task
        ([0, 1, 4, 6, 7], 3, [0, 1, 4]),  # no domain fits 3: largest domains first
    ],
)
def test_choose(free, count, expected):
    assert nvlink.choose(topo(), free, count) == expected


@pytest.mark.parametrize(
    "free,group,expected",
    [
        (list(range(8)), [4, 5], 50 + 50 + 30 + 40 + 15),  # one domain, filled exactly, all free, one NUMA
        (list(range(8)), [0, 1], 50 + 50 + 40 + 15),  # one domain, not filled
        ([0, 1, 2], [0, 1], 50 + 50 + 15),  # card 3 of the domain is busy: no +40
        (list(range(8)), [3, 4], 50 - 20 - 10),  # across domains and NUMA nodes
        (list(range(8)), [6], 50 + 50 + 30 + 40 + 15),  # a lone PCIe card is its own (full) domain
    ],
)
def test_score_numbers(free, group, expected):
    assert nvlink.score(topo(), free, group) == expected


def test_no_data_is_neutral():
    assert nvlink.score(None, [0, 1], [0, 1]) == 50
    assert nvlink.has_domain_for(None, [0], 4)


def node(id, labels=None, busy=()):
    gpus = [GpuSnap(i, "nvidia", 81920, holders=[(99, 1, None)] if i in busy else []) for i in range(8)]
    return NodeSnap(id=id, status="online", executable=True, labels=labels or {}, gpus=gpus)


def test_required_filters_nodes_without_a_big_enough_domain():
    pcie_only = node("pcie", {nvlink.TOPOLOGY_LABEL: json.dumps({"nvlink": [], "numa": {}})})
    linked = node("linked", {nvlink.TOPOLOGY_LABEL: TOPOLOGY})
    unknown = node("unknown")
    task = TaskReq(id=1, tenant_id=1, gpu_required=4, labels={"nvlink": "required"})
    decisions, _ = place([task], [pcie_only, linked], PluginSettings(), lambda a, b: True)
    assert decisions[0].node_id == "linked" and decisions[0].gpu_indices == [0, 1, 2, 3]
    _, failures = place([task], [node("pcie", pcie_only.labels)], PluginSettings(), lambda a, b: True)
    assert failures[0].removed == {"nvlink": 1}
    decisions, _ = place([task], [unknown], PluginSettings(), lambda a, b: True)
    assert decisions  # no data: the filter lets it through


def test_placement_prefers_the_node_where_the_group_stays_in_one_domain():
    split = node("a-split", {nvlink.TOPOLOGY_LABEL: TOPOLOGY}, busy=(1, 4))  # no domain has 2 free... {0,2,3} has 3
    whole = node("b-whole", {nvlink.TOPOLOGY_LABEL: TOPOLOGY})
    task = TaskReq(id=1, tenant_id=1, gpu_required=2)
    decisions, _ = place([task], [split, whole], PluginSettings(), lambda a, b: True)
    assert decisions[0].node_id == "b-whole" and decisions[0].gpu_indices == [4, 5]
