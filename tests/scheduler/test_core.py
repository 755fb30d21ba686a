"""The pure scheduler core: no database, numbers pinned."""

import pytest

from apps.scheduler.core import (
    GpuSnap,
    PluginSettings,
    layout_score,
    place,
    score_rdma,
    score_topology,
    utilisation,
)
from tests.scheduler.snapshots import SAME_TENANT_ONLY, gpus, node, task


@pytest.mark.parametrize(
    "node_kw,task_kw,expected",
    [
        ({}, {}, 50),
        ({"region": "r1", "zone": "z1", "rack": "k1"}, {"labels": {"region": "r1"}}, 55),
        ({"region": "r1", "zone": "z1", "rack": "k1"}, {"labels": {"region": "r1", "zone": "z1"}}, 70),
        ({"region": "r1", "zone": "z1", "rack": "k1"}, {"labels": {"region": "r1", "zone": "z1", "rack": "k1"}}, 80),
        ({"region": "r1", "zone": "z1", "rack": "k1"}, {"labels": {"rack": "k1"}}, 60),
        ({}, {"labels": {"region": "r1"}}, 50),  # no data on the node: neutral
        ({"region": "r2"}, {"labels": {"region": "r1"}}, 50),
    ],
)
def test_topology_scores(node_kw, task_kw, expected):
    assert score_topology(node("n", **node_kw), task(**task_kw)) == expected


@pytest.mark.parametrize(
    "labels,expected",
    [
        ({}, 50),
        ({"rdma": "true"}, 70),
        ({"rdma": "true", "rdma-speed": "100"}, 80),
        ({"rdma": "true", "rdma-speed": "400"}, 100),
        ({"rdma": "false"}, 40),
        ({"rdma": "true", "rdma-speed": "fast"}, 70),
    ],
)
def test_rdma_scores(labels, expected):
    assert score_rdma(node("n", labels=labels)) == expected


def test_rdma_required_filters_only_nodes_that_say_no():
    nodes = [node("a", labels={"rdma": "false"}), node("b")]
    decisions, _ = place([task(labels={"rdma": "required"})], nodes, PluginSettings(), SAME_TENANT_ONLY)
    assert decisions[0].node_id == "b"
    _, failures = place(
        [task(labels={"rdma": "required"})], [node("a", labels={"rdma": "false"})], PluginSettings(), SAME_TENANT_ONLY
    )
    assert failures[0].removed == {"rdma": 1}


def test_spread_prefers_the_emptier_node_and_binpack_the_fuller():
    busy = node("busy", cpu_used=80.0, memory_used=80.0)
    idle = node("idle", cpu_used=10.0, memory_used=10.0)
    assert layout_score("spread", utilisation(idle)) > layout_score("spread", utilisation(busy))
    assert layout_score("binpack", utilisation(busy)) > layout_score("binpack", utilisation(idle))
    spread, _ = place([task()], [busy, idle], PluginSettings(layout="spread"), SAME_TENANT_ONLY)
    binpack, _ = place(
        [task()],
        [node("busy", cpu_used=80.0, memory_used=80.0), node("idle", cpu_used=10.0, memory_used=10.0)],
        PluginSettings(layout="binpack"),
        SAME_TENANT_ONLY,
    )
    assert (spread[0].node_id, binpack[0].node_id) == ("idle", "busy")


def test_the_filter_chain_and_its_counts():
    nodes = [
        node("offline", status="offline"),
        node("broken", executable=False),
        node("other-tenant", tenant_id=2),
        node("small", n=1),
        node("ascend", gpus=gpus(8, vendor="ascend")),
    ]
    _, failures = place([task(gpus=2, gpu_type="nvidia")], nodes, PluginSettings(), SAME_TENANT_ONLY)
    assert failures[0].code == "InsufficientResources"
    assert failures[0].removed == {"unavailable": 2, "tenant": 1, "capacity": 2}
    _, none = place([task()], [node("x", status="offline")], PluginSettings(), SAME_TENANT_ONLY)
    assert none[0].code == "NoSchedulableNodes"


def test_gpu_type_matches_case_insensitively_and_lost_cards_are_never_used():
    n = node("n", gpus=[GpuSnap(0, "NVIDIA", 81920, lost=True), GpuSnap(1, "NVIDIA", 81920)])
    decisions, _ = place([task(gpu_type="nvidia")], [n], PluginSettings(), SAME_TENANT_ONLY)
    assert decisions[0].gpu_indices == [1]
    _, failures = place([task(id=2, gpu_type="nvidia")], [n], PluginSettings(), SAME_TENANT_ONLY)
    assert failures[0].code == "InsufficientResources"


def test_a_cycle_never_gives_a_card_twice():
    n = node("n", n=4)
    decisions, failures = place([task(id=i, gpus=2) for i in range(3)], [n], PluginSettings(), SAME_TENANT_ONLY)
    assert [d.task_id for d in decisions] == [0, 1] and [f.task_id for f in failures] == [2]
    taken = [i for d in decisions for i in d.gpu_indices]
    assert sorted(taken) == [0, 1, 2, 3]


def test_memory_only_tasks_share_a_card_within_a_tenant_or_group_only():
    n = node("n", n=1, gpus=gpus(1, memory=81920))
    first = task(id=1, gpus=0, gpu_memory_mb=20000, tenant=1)
    same = task(id=2, gpus=0, gpu_memory_mb=20000, tenant=1)
    other = task(id=3, gpus=0, gpu_memory_mb=20000, tenant=2)
    decisions, failures = place([first, same, other], [n], PluginSettings(), SAME_TENANT_ONLY)
    assert [d.task_id for d in decisions] == [1, 2]
    assert failures[0].code == "NoTenantEligibleGPU" and failures[0].removed == {"tenant_sharing": 1}
    grouped = node("n", n=1, gpus=gpus(1, memory=81920))
    decisions, failures = place([first, other], [grouped], PluginSettings(), lambda a, b: True)
    assert [d.task_id for d in decisions] == [1, 3] and not failures


def test_memory_only_respects_the_reserve_and_whole_cards_are_exclusive():
    n = node("n", n=1, gpus=gpus(1, memory=10000))
    # reserve: max(500 MB, 10 %) = 1000 MB of 10000
    _, failures = place([task(gpus=0, gpu_memory_mb=9500)], [n], PluginSettings(), SAME_TENANT_ONLY)
    assert failures
    decisions, _ = place([task(id=1, gpus=0, gpu_memory_mb=9000)], [n], PluginSettings(), SAME_TENANT_ONLY)
    assert decisions
    _, failures = place([task(id=2, gpus=1)], [n], PluginSettings(), SAME_TENANT_ONLY)
    assert failures  # a card with a share on it is not free for a whole-card task


def test_whole_card_tasks_check_memory_as_admission():
    small = node("small", gpus=gpus(2, memory=24000))
    big = node("big", gpus=gpus(2, memory=81920))
    decisions, _ = place([task(gpus=1, gpu_memory_mb=40000)], [small, big], PluginSettings(), SAME_TENANT_ONLY)
    assert decisions[0].node_id == "big"


def test_cards_near_full_memory_are_skipped():
    n = node(
        "n", gpus=[GpuSnap(0, "nvidia", 10000, memory_used_mb=9600), GpuSnap(1, "nvidia", 10000, memory_used_mb=100)]
    )
    decisions, _ = place([task()], [n], PluginSettings(), SAME_TENANT_ONLY)
    assert decisions[0].gpu_indices == [1]


def test_ties_break_by_node_id_and_cpu_only_tasks_need_no_cards():
    decisions, _ = place([task(gpus=0)], [node("b", n=0), node("a", n=0)], PluginSettings(), SAME_TENANT_ONLY)
    assert decisions[0].node_id == "a" and decisions[0].gpu_indices == []


@pytest.mark.parametrize(
    "node_kw,card_kw,placed",
    [
        ({}, {}, True),
        ({"cpu_used": 90.0}, {}, False),
        ({"memory_used": 95.0}, {}, False),
        ({"cpu_used": 89.9, "memory_used": 89.9}, {}, True),
        ({}, {"utilization": 95.0}, False),
        ({}, {"temperature": 79.0}, False),
        ({}, {"temperature": 78.9, "utilization": 94.9}, True),
    ],
)
def test_load_thresholds(node_kw, card_kw, placed):
    n = node("n", gpus=[GpuSnap(0, "nvidia", 81920, **card_kw)], **node_kw)
    decisions, failures = place([task()], [n], PluginSettings(), SAME_TENANT_ONLY)
    assert bool(decisions) == placed
    if not placed and node_kw:
        assert failures[0].removed == {"load": 1}


def test_thresholds_are_configurable():
    n = node("n", cpu_used=85.0)
    _, failures = place([task()], [n], PluginSettings(cpu_percent_max=80), SAME_TENANT_ONLY)
    assert failures[0].removed == {"load": 1}


def test_inference_needs_a_free_host_port_and_takes_one():
    full, roomy = node("full", ports_free=0), node("roomy", ports_free=1)
    first, second = task(id=1, kind="inference"), task(id=2, kind="inference")
    decisions, failures = place([first, second], [full, roomy], PluginSettings(), SAME_TENANT_ONLY)
    assert [(d.task_id, d.node_id) for d in decisions] == [(1, "roomy")]
    assert failures[0].task_id == 2 and failures[0].removed == {"ports": 2}
    # jobs do not need one
    decisions, _ = place([task(id=3)], [full], PluginSettings(), SAME_TENANT_ONLY)
    assert decisions[0].node_id == "full"
