"""The start-time forecast on the pure core (apps.scheduler.core.forecast): the queue
simulated forward with known durations gives exact starts; the real order (priority)
decides who goes first; what can never start, or not within the bounds, has no estimate
and says why."""

import random

from apps.scheduler.core import PluginSettings
from apps.scheduler.core.forecast import (
    BEYOND,
    FITS_NOW,
    NEVER_FITS,
    TYPE_ABSENT,
    Duration,
    estimate,
    simulate,
)
from apps.scheduler.core.queues import QueueSpec
from tests.scheduler.snapshots import SAME_TENANT_ONLY, group, node, task

NOW = 1_000_000.0
ANYONE = lambda a, b: True  # noqa: E731


def busy_node():
    """One node of 8 cards: task 1 on cards 0-3 ends at NOW + 100, task 2 on 4-7 at NOW + 300."""
    one = node("n0")
    for index in range(8):
        one.gpus[index].holders.append((1 if index < 4 else 2, 1, None))
    return [one]


def ends(*pairs):
    return {task_id: Duration(end, end, "test") for task_id, end in pairs}


def run(queue, nodes, running, durations, **kw):
    return estimate(queue, nodes, PluginSettings(), SAME_TENANT_ONLY, NOW, running, durations, **kw)


def test_an_eight_card_task_starts_when_the_last_running_task_ends():
    waiting = task(id=10, gpus=8)
    estimates = run([waiting], busy_node(), ends((1, NOW + 100), (2, NOW + 300)), {})
    assert estimates["task", 10].p50 == NOW + 300
    assert estimates["task", 10].p90 == NOW + 300


def test_a_four_card_task_takes_the_first_cards_that_free_up_and_the_next_waits_for_it():
    first, second = task(id=10, gpus=4), task(id=11, gpus=8)
    durations = {("task", 10): Duration(500, 500, "declared")}
    estimates = run([first, second], busy_node(), ends((1, NOW + 100), (2, NOW + 300)), durations)
    assert estimates["task", 10].p50 == NOW + 100
    # the 8-card task needs task 10's cards too: they free at NOW + 100 + 500
    assert estimates["task", 11].p50 == NOW + 600


def test_the_p90_comes_from_the_durations_p90():
    waiting = task(id=10, gpus=8)
    running = {1: Duration(NOW + 100, NOW + 150, "test"), 2: Duration(NOW + 300, NOW + 900, "test")}
    estimate_ = run([waiting], busy_node(), running, {})["task", 10]
    assert (estimate_.p50, estimate_.p90) == (NOW + 300, NOW + 900)


def test_work_that_fits_now_starts_now():
    estimates = run([task(id=10, gpus=2)], [node("n0")], {}, {})
    assert estimates["task", 10].p50 == NOW
    assert estimates["task", 10].basis == FITS_NOW


def test_priority_decides_who_takes_the_cards_first():
    low, high = task(id=10, gpus=8, priority=10), task(id=11, gpus=8, priority=90)
    durations = {("task", 10): Duration(1000, 1000, "d"), ("task", 11): Duration(2000, 2000, "d")}
    # queue order as the shell hands it: priority first
    estimates = run([high, low], busy_node(), ends((1, NOW + 100), (2, NOW + 300)), durations)
    assert estimates["task", 11].p50 == NOW + 300
    assert estimates["task", 10].p50 == NOW + 300 + 2000


def test_a_gang_starts_when_its_cards_are_free_on_enough_nodes():
    nodes = [*busy_node(), node("n1")]
    gang = group(id=5, workers=2, gpus=8)
    estimates = run([gang], nodes, ends((1, NOW + 100), (2, NOW + 300)), {})
    assert estimates["group", 5].p50 == NOW + 300


def test_a_type_not_in_the_cluster_has_no_estimate_and_says_why():
    waiting = task(id=10, gpus=1, gpu_type="amd")
    estimates = run([waiting], [node("n0")], {}, {})
    assert estimates["task", 10].p50 is None
    assert estimates["task", 10].basis == TYPE_ABSENT


def test_work_larger_than_any_node_never_fits():
    estimates = run([task(id=10, gpus=16)], [node("n0")], {}, {})
    assert (estimates["task", 10].p50, estimates["task", 10].basis) == (None, NEVER_FITS)


def test_work_beyond_the_horizon_has_no_estimate():
    waiting = task(id=10, gpus=8)
    estimates = run([waiting], busy_node(), ends((1, NOW + 100), (2, NOW + 10_000)), {}, horizon=3600)
    assert (estimates["task", 10].p50, estimates["task", 10].basis) == (None, BEYOND)


def test_the_simulation_leaves_the_snapshot_as_it_was():
    nodes = busy_node()
    simulate([task(id=10, gpus=8)], nodes, PluginSettings(), ANYONE, NOW, {1: NOW + 100, 2: NOW + 300}, {})
    assert [gpu.holders for gpu in nodes[0].gpus] == [[(1, 1, None)]] * 4 + [[(2, 1, None)]] * 4


def test_a_reserving_gang_keeps_later_undeclared_work_off_its_cards():
    """The gang (priority 60) reserves n0's cards as they free; a 1-card task behind it
    that declares no duration cannot backfill and waits for the gang to end."""
    gang = group(id=5, workers=1, gpus=8, priority=60)
    small = task(id=10, gpus=1, priority=40)
    durations = {("group", 5): Duration(1000, 1000, "d")}
    estimates = run([gang, small], busy_node(), ends((1, NOW + 100), (2, NOW + 300)), durations, reserving={5: ()})
    assert estimates["group", 5].p50 == NOW + 300
    assert estimates["task", 10].p50 == NOW + 1300


def test_ends_closer_than_the_step_fraction_are_one_step():
    """Task 2 ends 10 s after task 1, within 5 % of the 1000 s waited: one step at 1050, so
    the estimate is late by at most 5 % of the wait."""
    waiting = task(id=10, gpus=8)
    estimates = run([waiting], busy_node(), ends((1, NOW + 1000), (2, NOW + 1010)), {})
    assert estimates["task", 10].p50 == NOW + 1050


def test_work_that_cannot_fit_by_count_is_skipped_without_changing_the_others():
    """A step with two free cards tries only the work two cards can take: the 8-card task
    ahead of the 2-card one is left out of that step, and both get the starts they would."""
    nodes = busy_node()
    big, small = task(id=10, gpus=8), task(id=11, gpus=2)
    durations = {("task", 10): Duration(1000, 1000, "d"), ("task", 11): Duration(50, 50, "d")}
    estimates = run([big, small], nodes, ends((1, NOW + 100), (2, NOW + 300)), durations)
    assert estimates["task", 11].p50 == NOW + 100
    assert estimates["task", 10].p50 == NOW + 300


def test_placing_in_passes_decides_as_placing_the_whole_queue_at_once():
    """Without queues a step places in passes (forecast._place_in_passes); with a queue
    spec (of a tenant with no work here: it limits nobody) every item is tried in one
    call. A mixed queue on a mixed, busy fleet gets the same starts either way."""
    rng = random.Random(7)
    nodes = [node(f"n{i}", n=8) for i in range(6)]
    running, task_id = {}, 1
    for one in nodes:
        for gpu in one.gpus:
            if rng.random() < 0.8:
                gpu.holders.append((task_id, 1, None))
                running[task_id] = NOW + rng.uniform(10, 5000)
                task_id += 1
    queue = [
        task(id=100 + k, gpus=rng.choice([1, 1, 2, 4, 8, 16]), priority=rng.choice([30, 50]), tenant=rng.choice([1, 2]))
        for k in range(60)
    ]
    queue.sort(key=lambda item: -item.priority)
    durations = {("task", item.id): rng.uniform(100, 3000) for item in queue}
    alone = simulate(queue, nodes, PluginSettings(), ANYONE, NOW, running, durations)
    whole = simulate(queue, nodes, PluginSettings(), ANYONE, NOW, running, durations, specs=[QueueSpec(999, "other")])
    assert alone.starts == whole.starts
    assert alone.unplaced == whole.unplaced
    assert len(alone.starts) > 30


def test_each_item_without_a_start_is_asked_about_the_idle_cluster_on_its_own():
    """Two 8-card tasks past the horizon would each fit the idle node: both are BEYOND (the
    first one's trial on the idle cluster does not keep the node from the second), the
    16-card one never fits."""
    queue = [task(id=10, gpus=8), task(id=11, gpus=8), task(id=12, gpus=16)]
    estimates = run(queue, busy_node(), ends((1, NOW + 10_000), (2, NOW + 10_000)), {}, horizon=3600)
    assert [estimates["task", n].basis for n in (10, 11, 12)] == [BEYOND, BEYOND, NEVER_FITS]
