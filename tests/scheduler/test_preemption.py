"""Preemption planning in the pure core: who may be evicted, the minimal victim set,
the node that needs the fewest victims, and waiting for what is already being freed."""

import pytest

from apps.scheduler.core import Occupant, PluginSettings, occupants_by_node, plan_preemption
from tests.scheduler.snapshots import SAME_TENANT_ONLY, node, task


def held(node_snap, *holders):
    """Put (task id, card indices) holders on the node's cards, whole cards."""
    for task_id, indices in holders:
        for index in indices:
            node_snap.gpus[index].holders.append((task_id, 1, None))
    return node_snap


def occupant(id, node_id, priority=10, created=0.0, status="running", kind="job", preemptible=True):
    return Occupant(id, node_id, status, kind, preemptible, priority, created)


def plan(preemptor, nodes, occupants, stage="running", taken=frozenset()):
    settings = PluginSettings(preempt_stage=stage)
    return plan_preemption(preemptor, nodes, occupants_by_node(occupants), settings, SAME_TENANT_ONLY, set(taken))


def full_node(id="n1", size=4):
    """A node whose every card is held by one single-card task: ids 101, 102, …"""
    return held(node(id, n=size), *[(101 + i, [i]) for i in range(size)])


def test_the_least_important_newest_task_goes_first():
    n1 = full_node()
    occupants = [
        occupant(101, "n1", priority=10, created=1.0),
        occupant(102, "n1", priority=10, created=2.0),  # same priority, newer: less work lost
        occupant(103, "n1", priority=20),
        occupant(104, "n1", priority=30),
    ]
    assert plan(task(gpus=1, priority=50), [n1], occupants).victims == [102]
    assert plan(task(gpus=2, priority=50), [n1], occupants).victims == [102, 101]
    assert plan(task(gpus=3, priority=50), [n1], occupants).victims == [102, 101, 103]


def test_ties_on_priority_and_age_fall_to_the_task_id():
    n1 = full_node()
    occupants = [occupant(101 + i, "n1", priority=10, created=5.0) for i in range(4)]
    assert plan(task(gpus=1, priority=50), [n1], occupants).victims == [101]


@pytest.mark.parametrize(
    "victim_kw",
    [
        {"kind": "training"},  # training never takes part in preemption
        {"kind": "inference"},  # killing a service is an outage
        {"preemptible": False},
        {"priority": 50},  # strictly lower only
        {"priority": 70},
        {"status": "scheduled"},  # the default stage takes running tasks only
    ],
)
def test_who_may_not_be_preempted(victim_kw):
    n1 = held(node("n1", n=1), (101, [0]))
    assert plan(task(gpus=1, priority=50), [n1], [occupant(101, "n1", **victim_kw)]) is None


def test_stage_scheduled_also_takes_tasks_not_started_yet():
    n1 = held(node("n1", n=1), (101, [0]))
    occupants = [occupant(101, "n1", status="scheduled")]
    assert plan(task(gpus=1, priority=50), [n1], occupants, stage="scheduled").victims == [101]
    assert plan(task(gpus=1, priority=50), [n1], occupants, stage="disabled") is None


def test_training_never_preempts_and_inference_may():
    n1 = held(node("n1", n=1), (101, [0]))
    occupants = [occupant(101, "n1")]
    assert plan(task(gpus=1, priority=90, kind="training"), [n1], occupants) is None
    assert plan(task(gpus=1, priority=90, kind="inference"), [n1], occupants).victims == [101]


def test_the_node_needing_the_fewest_victims_wins_then_the_smaller_priority_sum_then_the_id():
    # a: two single-card tasks must go; b: one two-card task is enough
    a = held(node("a", n=2), (1, [0]), (2, [1]))
    b = held(node("b", n=2), (3, [0, 1]))
    occupants = [occupant(1, "a", priority=1), occupant(2, "a", priority=1), occupant(3, "b", priority=40)]
    assert plan(task(gpus=2, priority=50), [a, b], occupants).node_id == "b"
    # equal victim counts: the smaller priority sum
    c = held(node("c", n=2), (4, [0, 1]))
    occupants.append(occupant(4, "c", priority=30))
    assert plan(task(gpus=2, priority=50), [a, b, c], occupants).victims == [4]
    # and then the node id
    d = held(node("d", n=2), (5, [0, 1]))
    occupants.append(occupant(5, "d", priority=30))
    assert plan(task(gpus=2, priority=50), [d, c, b, a], occupants).node_id == "c"


def test_nobody_is_evicted_when_evicting_everyone_would_not_be_enough():
    n1 = held(node("n1", n=2), (101, [0]), (102, [1]))
    occupants = [occupant(101, "n1"), occupant(102, "n1", kind="training")]
    assert plan(task(gpus=2, priority=50), [n1], occupants) is None


def test_cards_already_being_freed_count_first_and_the_task_waits_for_them():
    n1 = held(node("n1", n=2), (101, [0]), (102, [1]))
    occupants = [occupant(101, "n1", status="preempting", kind="job", priority=90), occupant(102, "n1")]
    waiting = plan(task(gpus=1, priority=50), [n1], occupants)
    assert waiting.node_id == "n1" and waiting.victims == []
    assert plan(task(gpus=2, priority=50), [n1], occupants).victims == [102]


def test_victims_chosen_for_a_task_ahead_are_not_chosen_twice():
    n1 = held(node("n1", n=2), (101, [0]), (102, [1]))
    occupants = [occupant(101, "n1"), occupant(102, "n1", created=1.0)]
    first = plan(task(id=1, gpus=1, priority=90), [n1], occupants)
    assert first.victims == [102]
    second = plan(task(id=2, gpus=2, priority=80), [n1], occupants, taken=first.victims)
    assert second.victims == [101]


def test_unavailable_foreign_and_overloaded_nodes_are_not_considered():
    down = held(node("down", n=1, status="offline"), (1, [0]))
    foreign = held(node("foreign", n=1, tenant_id=2), (2, [0]))
    hot = held(node("hot", n=1, cpu_used=95.0), (3, [0]))
    occupants = [occupant(1, "down"), occupant(2, "foreign"), occupant(3, "hot")]
    assert plan(task(gpus=1, priority=50), [down, foreign, hot], occupants) is None


def test_a_memory_only_task_may_preempt_a_whole_card_holder():
    n1 = held(node("n1", n=1), (101, [0]))
    preemptor = task(gpus=0, priority=50, gpu_memory_mb=10_000)
    assert plan(preemptor, [n1], [occupant(101, "n1")]).victims == [101]
