"""A replica's share clock (apps.gateway.usage.ShareClock), on a clock the test sets: a
request's GPU-seconds are its share of the replica's cards while it held them, so the
requests of a replica add up to its cards times the time it was busy, however they
overlap; idle time counts for nobody, and a replica's size change counts from then on."""

import random

import pytest

from apps.gateway.usage import ShareClock, ShareClocks


def test_a_lone_request_has_all_the_replicas_cards():
    clock = ShareClock()
    started = clock.start(100.0, cards=2)
    assert clock.end(101.0, started) == pytest.approx(2.0)


def test_four_requests_at_once_on_one_card_come_to_one_gpu_second():
    clock = ShareClock()
    starts = [clock.start(10.0, cards=1) for _ in range(4)]
    shares = [clock.end(11.0, started) for started in starts]
    assert shares == pytest.approx([0.25] * 4) and sum(shares) == pytest.approx(1.0)


def test_overlapping_requests_share_only_while_they_overlap():
    clock = ShareClock()
    a = clock.start(0.0, cards=1)
    b = clock.start(1.0, cards=1)  # a alone for 1 s, then both for 1 s
    spent_a = clock.end(2.0, a)
    spent_b = clock.end(3.0, b)  # then b alone for 1 s
    assert (spent_a, spent_b) == pytest.approx((1.5, 1.5))


def test_a_request_cancelled_early_takes_only_its_time_and_the_others_get_the_rest():
    clock = ShareClock()
    long_one = clock.start(0.0, cards=4)
    cancelled = clock.start(0.0, cards=4)
    assert clock.end(0.5, cancelled) == pytest.approx(4 * 0.5 / 2)  # the client left after 0.5 s
    assert clock.end(2.0, long_one) == pytest.approx(4 * 0.5 / 2 + 4 * 1.5)


def test_idle_time_counts_for_nobody_and_the_reading_starts_over():
    clock = ShareClock()
    first = clock.start(0.0, cards=1)
    assert clock.end(1.0, first) == pytest.approx(1.0)
    assert clock.in_flight == 0 and clock.reading == 0.0
    later = clock.start(50.0, cards=1)  # 49 idle seconds in between
    assert clock.end(50.5, later) == pytest.approx(0.5)


def test_a_replica_resized_counts_its_new_cards_from_then_on():
    clock = ShareClock()
    before = clock.start(0.0, cards=1)
    after = clock.start(1.0, cards=3)  # the catalog now says 3 cards: from t=1 on
    assert clock.end(2.0, before) == pytest.approx(1.0 + 3 * 1.0 / 2)
    assert clock.end(3.0, after) == pytest.approx(3 * 1.0 / 2 + 3 * 1.0)


def test_any_overlap_adds_up_to_the_cards_times_the_busy_time():
    """Random requests on a 2-card replica: their shares sum to 2 × the length of the
    union of their intervals, the same whatever order they start and end in."""
    rng = random.Random(31)
    intervals = [(start := rng.uniform(0, 100), start + rng.uniform(0.01, 20)) for _ in range(200)]
    events = sorted(
        [(s, 1, i) for i, (s, _) in enumerate(intervals)] + [(e, 0, i) for i, (_, e) in enumerate(intervals)]
    )
    clock, started, spent = ShareClock(), {}, {}
    for at, is_start, i in events:
        if is_start:
            started[i] = clock.start(at, cards=2)
        else:
            spent[i] = clock.end(at, started[i])
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    assert all(share > 0 for share in spent.values())
    assert sum(spent.values()) == pytest.approx(2 * busy, rel=1e-9)


def test_the_clocks_keep_one_per_replica_and_drop_the_idle_ones():
    clocks = ShareClocks()
    busy = clocks.of("http://10.0.0.1:8000")
    assert clocks.of("http://10.0.0.1:8000") is busy
    busy.start(0.0, cards=1)
    idle = clocks.of("http://10.0.0.2:8000")
    idle.end(1.0, idle.start(0.0, cards=1))
    clocks.clean()
    assert len(clocks) == 1 and clocks.of("http://10.0.0.1:8000") is busy
