"""The pure core's admission on what is really free, and cordoned cards (issue 21):
memory-bounded placement on min(ledger-free, measured-free) with the reserve, reasons
`memory_in_use` and `cordoned`, no database."""

import pytest

from apps.scheduler.core import (
    FleetView,
    GpuSnap,
    Occupant,
    PluginSettings,
    memory_detail,
    occupants_by_node,
    place,
    place_queue,
    plan_preemption,
)
from apps.slices.planning import mig_model
from tests.scheduler.snapshots import SAME_TENANT_ONLY, group, node, task

GB = 1024
TOTAL = 80 * GB  # 81920: the reserve is max(500 MB, 10 %) = 8192 MB
SETTINGS = PluginSettings()


def card(index=0, used=None, total=TOTAL, **kw):
    return GpuSnap(index, "nvidia", total, memory_used_mb=used, **kw)


def one_card_node(used=None, **kw):
    return node("n1", gpus=[card(used=used, **kw)])


def share(memory_gb, id=1, **kw):
    return task(id=id, gpus=0, gpu_memory_mb=memory_gb * GB, **kw)


def whole(memory_gb=None, id=1, gpus=1, **kw):
    return task(id=id, gpus=gpus, gpu_memory_mb=memory_gb * GB if memory_gb else None, **kw)


# --- the card's numbers ----------------------------------------------------------------


def test_measured_free_is_total_less_the_reading_and_none_without_one():
    assert card(used=30 * GB).measured_free_mb() == 50 * GB
    assert card(used=None).measured_free_mb() is None
    assert card(used=100 * GB).measured_free_mb() == 0  # a reading above the total: nothing free
    assert GpuSnap(0, "nvidia", None, memory_used_mb=10).measured_free_mb() is None  # no total: ledger only


def test_share_free_is_the_smaller_of_ledger_and_measured_after_the_reserve():
    gpu = card(used=30 * GB, holders=[(9, 1, 10 * GB)])
    assert gpu.memory_free_mb(8192) == 50 * GB - 8192  # measured (50 GB) below ledger (70 GB)
    assert gpu.memory_free_mb(8192, measured=False) == 70 * GB - 8192
    quiet = card(used=5 * GB, holders=[(9, 1, 10 * GB)])  # the holder uses less than it holds
    assert quiet.memory_free_mb(8192) == 70 * GB - 8192  # the ledger is the smaller


@pytest.mark.parametrize(
    "gpu",
    [
        card(used=30 * GB, holders=[(9, 1, 10 * GB)]),
        card(used=5 * GB, holders=[(9, 1, 10 * GB)]),
        card(used=None),
        card(used=100 * GB),
    ],
)
def test_both_rooms_in_one_pass_agree_with_each_alone(gpu):
    assert gpu.share_rooms_mb(8192) == (gpu.share_room_mb(8192), gpu.share_room_mb(8192, measured=False))


# --- the case: 30 GB measured but unknown on an 80 GB card ---------------------


@pytest.mark.parametrize("shape", [share, whole], ids=["share", "whole-card"])
def test_unknown_use_blocks_a_60_gb_task_and_admits_a_40_gb_one(shape):
    decisions, failures = place([shape(60)], [one_card_node(used=30 * GB)], SETTINGS, SAME_TENANT_ONLY)
    assert decisions == [] and failures[0].removed == {"memory_in_use": 1}
    assert failures[0].code == "InsufficientResources"
    decisions, failures = place([shape(40)], [one_card_node(used=30 * GB)], SETTINGS, SAME_TENANT_ONLY)
    assert failures == [] and decisions[0].node_id == "n1"


@pytest.mark.parametrize("shape", [share, whole], ids=["share", "whole-card"])
def test_without_a_reading_the_ledger_alone_admits(shape):
    decisions, _ = place([shape(60)], [one_card_node(used=None)], SETTINGS, SAME_TENANT_ONLY)
    assert decisions[0].node_id == "n1"


def test_a_reading_above_the_total_admits_no_memory_bounded_task():
    # a bogus reading (above the card's total) counts as a full card, and the load
    # threshold (95 % memory) keeps even a plain whole-card task off it
    nodes = [one_card_node(used=TOTAL + 4096)]
    _, failures = place([share(1)], nodes, SETTINGS, SAME_TENANT_ONLY)
    assert failures[0].removed == {"capacity": 1}
    _, failures = place([whole(1)], [one_card_node(used=TOTAL + 4096)], SETTINGS, SAME_TENANT_ONLY)
    assert failures[0].removed == {"capacity": 1}


def test_a_whole_card_task_without_gpu_memory_mb_is_not_memory_bounded():
    decisions, _ = place([whole()], [one_card_node(used=60 * GB)], SETTINGS, SAME_TENANT_ONLY)
    assert decisions[0].gpu_indices == [0]  # 73 % in use: under the 95 % threshold


def test_capacity_not_memory_in_use_when_the_ledger_is_short_too():
    gpu = card(used=30 * GB, holders=[(9, 1, 50 * GB)])
    _, failures = place([share(40)], [node("n1", gpus=[gpu])], SETTINGS, SAME_TENANT_ONLY)
    assert failures[0].removed == {"capacity": 1}


def test_shares_placed_in_one_cycle_count_against_the_reading():
    # 50 GB measured free, 42 GB after the reserve: one 30 GB share fits, a second does not
    # (the reading cannot show the first yet), though the ledger alone would take both
    decisions, failures = place(
        [share(30, id=1), share(30, id=2)], [one_card_node(used=30 * GB)], SETTINGS, SAME_TENANT_ONLY
    )
    assert [d.task_id for d in decisions] == [1]
    assert failures[0].task_id == 2 and failures[0].removed == {"memory_in_use": 1}


def test_the_card_with_the_room_is_picked_when_another_is_taken_by_unknown_use():
    nodes = [node("n1", gpus=[card(0, used=70 * GB), card(1, used=1 * GB)])]
    decisions, _ = place([share(20)], nodes, SETTINGS, SAME_TENANT_ONLY)
    assert decisions[0].gpu_indices == [1]
    decisions, _ = place([whole(20)], [node("n1", gpus=[card(0, used=70 * GB), card(1)])], SETTINGS, SAME_TENANT_ONLY)
    assert decisions[0].gpu_indices == [1]


def test_memory_detail_names_both_numbers_on_the_cards_where_the_reading_blocks():
    nodes = [node("n1", gpus=[card(0, used=30 * GB), card(1, used=1 * GB, holders=[(9, 1, 75 * GB)])])]
    detail = memory_detail(share(60), nodes, SETTINGS, SAME_TENANT_ONLY)
    assert detail == [
        {
            "node_id": "n1",
            "gpu_index": 0,
            "ledger_free_mb": TOTAL,
            "measured_free_mb": 50 * GB,
            "reserve_mb": 8192,
            "needed_mb": 60 * GB,
        }
    ]  # card 1: the ledger is what is short, not the reading
    whole_detail = memory_detail(whole(60), [node("n1", gpus=[card(0, used=30 * GB)])], SETTINGS, SAME_TENANT_ONLY)
    assert whole_detail[0]["ledger_free_mb"] == TOTAL and whole_detail[0]["measured_free_mb"] == 50 * GB
    assert whole_detail[0]["reserve_mb"] == 0  # a whole card is the task's alone


def test_memory_detail_is_empty_for_a_task_no_reading_blocks():
    assert memory_detail(share(60), [one_card_node(used=None)], SETTINGS, SAME_TENANT_ONLY) == []
    assert memory_detail(whole(), [one_card_node(used=30 * GB)], SETTINGS, SAME_TENANT_ONLY) == []


# --- MIG: instances are partitions -------------------------------------------------------


def mig_card(used, carved_g=0, carved_memory=0):
    model = mig_model("NVIDIA A100-SXM4-80GB", TOTAL)
    return GpuSnap(
        0,
        "nvidia",
        TOTAL,
        memory_used_mb=used,
        mig=True,
        mig_model=model,
        model="NVIDIA A100-SXM4-80GB",
        carved_g=carved_g,
        carved_memory=carved_memory,
    )


def test_on_a_mig_card_use_inside_the_carved_instances_takes_no_uncarved_memory():
    # 4 of 8 memory slices carved (40 GB) and 35 GB in use inside them: the other 40 GB
    # are the room, as on the ledger
    assert mig_card(used=35 * GB, carved_g=3, carved_memory=4).share_room_mb(0) == 40 * GB
    # 60 GB in use: 20 GB beyond what the instances hold; the largest profile that
    # still fits in the 20 GB left is 2g.20gb
    assert mig_card(used=60 * GB, carved_g=3, carved_memory=4).share_room_mb(0) == 20 * GB
    assert mig_card(used=60 * GB, carved_g=3, carved_memory=4).share_room_mb(0, measured=False) == 40 * GB
    assert mig_card(used=None, carved_g=3, carved_memory=4).share_room_mb(0) == 40 * GB


# --- cordoned cards ------------------------------------------------------------------------


def test_a_cordoned_card_takes_no_whole_card_task_and_says_so():
    nodes = [node("n1", gpus=[card(0, cordoned=True), card(1)])]
    decisions, _ = place([whole()], nodes, SETTINGS, SAME_TENANT_ONLY)
    assert decisions[0].gpu_indices == [1]
    _, failures = place(
        [whole(gpus=2)], [node("n1", gpus=[card(0, cordoned=True), card(1)])], SETTINGS, SAME_TENANT_ONLY
    )
    assert failures[0].removed == {"cordoned": 1}


def test_a_cordoned_card_takes_no_share_and_says_so():
    _, failures = place([share(10)], [one_card_node(cordoned=True)], SETTINGS, SAME_TENANT_ONLY)
    assert failures[0].removed == {"cordoned": 1}
    decisions, _ = place([share(10)], [node("n1", gpus=[card(0, cordoned=True), card(1)])], SETTINGS, SAME_TENANT_ONLY)
    assert decisions[0].gpu_indices == [1]


def test_cordoned_is_not_the_reason_where_the_cordoned_card_would_not_do_either():
    # the cordoned card is taken anyway: capacity is what stands in the way
    gpu = card(0, cordoned=True, holders=[(9, 1, None)])
    _, failures = place([whole()], [node("n1", gpus=[gpu])], SETTINGS, SAME_TENANT_ONLY)
    assert failures[0].removed == {"capacity": 1}
    # a lost card that is also cordoned is lost: never counted
    _, failures = place([whole()], [node("n1", gpus=[card(0, cordoned=True, lost=True)])], SETTINGS, SAME_TENANT_ONLY)
    assert failures[0].removed == {"capacity": 1}


def test_a_group_is_not_placed_on_cordoned_cards():
    nodes = [node("a", n=0, gpus=[card(i, cordoned=(i == 0)) for i in range(8)]), node("b")]
    placement = place_queue([group(workers=2, gpus=8)], nodes, SETTINGS, SAME_TENANT_ONLY)
    assert placement.groups == [] and placement.group_failures[0].removed == {"cordoned": 1}
    placement = place_queue([group(workers=2, gpus=4)], nodes, SETTINGS, SAME_TENANT_ONLY)
    cards = {(d.node_id, i) for d in placement.groups[0].decisions for i in d.gpu_indices}
    assert ("a", 0) not in cards and len(cards) == 8


def test_preemption_never_plans_onto_a_cordoned_card():
    busy = node("n1", gpus=[card(0, cordoned=True, holders=[(7, 1, None)])])
    victims = occupants_by_node([Occupant(7, "n1", "running", "job", True, 10, 1.0)])
    assert plan_preemption(whole(id=1, priority=90), [busy], victims, SETTINGS, SAME_TENANT_ONLY) is None


def test_preemption_counts_the_victims_use_off_the_reading():
    # the card is full by the ledger and by the reading, both explained by the victim
    busy = node("n1", gpus=[card(0, used=70 * GB, holders=[(7, 1, 70 * GB)])])
    victims = occupants_by_node([Occupant(7, "n1", "running", "job", True, 10, 1.0)])
    plan = plan_preemption(share(40, priority=90), [busy], victims, SETTINGS, SAME_TENANT_ONLY)
    assert plan is not None and plan.victims == [7]
    # unknown use stays after the victim is gone: evicting it would not help
    unknown = node("n1", gpus=[card(0, used=75 * GB, holders=[(7, 1, 20 * GB)])])
    assert plan_preemption(share(40, priority=90), [unknown], victims, SETTINGS, SAME_TENANT_ONLY) is None


def test_fleet_view_knows_which_nodes_have_cordoned_cards():
    view = FleetView(
        [node("a", gpus=[card(0, cordoned=True)]), node("b"), node("c", gpus=[card(0, cordoned=True, lost=True)])],
        SETTINGS,
        SAME_TENANT_ONLY,
    )
    assert [view.has_cordoned(position) for position in range(3)] == [True, False, False]
    assert view.free == [0, 8, 0]
