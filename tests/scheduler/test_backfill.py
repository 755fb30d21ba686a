"""Backfill, in the pure core: work that declares its duration (max_duration) may use the
cards a waiting gang's reservation holds when it will end before the cards the gang still
lacks are expected free (from the running work's expected ends); anything else, and
anything when the ends are unknown, stays off them, and what the backfill does not take
stays held."""

from apps.scheduler.core import Held, PluginSettings, place_queue
from tests.scheduler.snapshots import SAME_TENANT_ONLY, group, node, task

NOW = 1_000_000.0
GANG = group(id=7, workers=2, gpus=8, priority=60)


def fleet():
    """n0 idle; n1 with cards 0-3 busy, task i+1 on card i, ending NOW + 1000·(i+1). The
    gang (2 × 8 cards) holds the 12 free cards and waits for n1's four: expected free at
    NOW + 4000."""
    nodes = [node("n0"), node("n1")]
    for index in range(4):
        nodes[1].gpus[index].holders.append((index + 1, 1, None))
    return nodes


ENDS = {index + 1: NOW + 1000 * (index + 1) for index in range(4)}


def cycle(queue, nodes, ends=ENDS, now=NOW, held=()):
    return place_queue(
        [GANG, *queue],
        nodes,
        PluginSettings(),
        SAME_TENANT_ONLY,
        reserving={GANG.id: ()},
        held=held,
        now=now,
        ends=ends,
    )


def held_cards(nodes):
    return sum(1 for n in nodes for gpu in n.gpus if any(holder[0] < 0 for holder in gpu.holders))


def test_the_reservation_is_dated_by_the_last_card_it_waits_for():
    placement = cycle([], fleet())
    [failure] = placement.group_failures
    assert failure.reservation.expected_free == NOW + 4000
    assert failure.reservation.as_dict()["expected_free"] == NOW + 4000


def test_work_that_ends_before_then_runs_on_the_held_cards():
    nodes = fleet()
    short = task(id=50, gpus=1, priority=40, max_duration=3000)
    exact = task(id=51, gpus=2, priority=40, max_duration=4000)
    placement = cycle([short, exact], nodes)
    assert {d.task_id for d in placement.decisions} == {50, 51}
    assert set(placement.backfilled) == {50, 51}
    assert sum(len(cards) for cards in placement.backfilled.values()) == 3
    # what the backfill did not take stays held
    assert held_cards(nodes) == 12 - 3


def test_work_that_would_outlast_the_wait_or_declares_nothing_stays_off():
    nodes = fleet()
    long = task(id=52, gpus=1, priority=40, max_duration=4001)
    undeclared = task(id=53, gpus=1, priority=40)
    placement = cycle([long, undeclared], nodes)
    assert placement.decisions == [] and placement.backfilled == {}
    assert {f.task_id: f.code for f in placement.failures} == {52: "InsufficientResources", 53: "InsufficientResources"}
    assert held_cards(nodes) == 12


def test_a_held_card_backfilled_is_not_held_again_for_work_behind_it():
    nodes = fleet()
    queue = [task(id=54, gpus=1, priority=40, max_duration=100), task(id=55, gpus=1, priority=30)]
    placement = cycle(queue, nodes)
    assert [d.task_id for d in placement.decisions] == [54]
    assert held_cards(nodes) == 11


def test_a_group_that_declares_its_duration_backfills_whole():
    nodes = fleet()
    small = group(id=8, workers=2, gpus=4, priority=40, first_member=2000, max_duration=2500)
    placement = cycle([small], nodes)
    [placed] = placement.groups
    assert placed.group_id == 8 and len(placed.decisions) == 2
    assert len(placement.backfilled[8]) == 8


def test_unknown_ends_backfill_nothing():
    short = task(id=56, gpus=1, priority=40, max_duration=10)
    # no ends at all (a dry run without a reservation in front), or one card's unknown
    for ends in (None, {k: v for k, v in ENDS.items() if k != 4}):
        nodes = fleet()
        placement = cycle([short], nodes, ends=ends)
        [failure] = placement.group_failures
        assert failure.reservation.expected_free is None
        assert placement.decisions == []


def test_a_standing_reservation_of_a_dry_run_backfills_by_its_stored_date():
    nodes = [node("n0")]
    standing = Held(group_id=9, tenant_id=1, cards={"n0": list(range(8))}, expected_free=NOW + 600)
    fits = task(id=57, gpus=2, max_duration=600)
    late = task(id=58, gpus=2, max_duration=601)
    for request, placed in ((fits, True), (late, False)):
        placement = place_queue([request], nodes, PluginSettings(), SAME_TENANT_ONLY, held=[standing], now=NOW, ends={})
        assert bool(placement.decisions) is placed
        for gpu in nodes[0].gpus:
            gpu.holders = []


def test_the_gang_starts_no_later_with_backfill_than_without():
    """A simulated stream: the gang waits for n1's four cards, which free up one by one;
    short declared tasks keep arriving. With backfill they run on the held cards
    meanwhile; the gang starts in the same round either way."""

    def run(backfill: bool):
        nodes = fleet()
        clock, running, next_id, ran = NOW, dict(ENDS), 100, 0
        for round_ in range(10):
            for task_id in [t for t, end in running.items() if end <= clock]:
                del running[task_id]
                for n in nodes:
                    for gpu in n.gpus:
                        gpu.holders = [h for h in gpu.holders if h[0] != task_id]
            arrivals = [task(id=next_id, gpus=1, priority=40, max_duration=500 if backfill else None)]
            next_id += 1
            placement = cycle(arrivals, nodes, ends=running, now=clock)
            for n in nodes:
                for gpu in n.gpus:
                    gpu.holders = [h for h in gpu.holders if h[0] > 0]
            if placement.groups:
                return round_, ran
            for decision in placement.decisions:
                running[decision.task_id] = clock + 500
                ran += 1
            clock += 1000
        return None, ran

    without, ran_without = run(backfill=False)
    with_backfill, ran_with = run(backfill=True)
    assert without == with_backfill == 4
    assert ran_without == 0 and ran_with == 4
