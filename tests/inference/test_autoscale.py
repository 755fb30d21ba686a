"""The AutoScaler's decisions on recorded signal series (apps/inference/autoscale.py): no
database, the time passed in."""

from datetime import UTC, datetime, timedelta

import pytest

from apps.inference.autoscale import (
    Direction,
    PolicyError,
    Sample,
    ScalingPolicy,
    ScalingState,
    decide,
    parse_policy,
    validate_policy,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
POLICY = ScalingPolicy(
    min_replicas=1,
    max_replicas=6,
    target_in_flight=8,
    scale_up_cooldown_s=60,
    scale_down_cooldown_s=300,
    scale_down_stabilisation_s=300,
)


def series(every=30, end=NOW, **signals):
    """Samples every `every` seconds ending at `end`, one per value; each keyword is a
    list of readings (None: not read), all of the same length."""
    lengths = {len(values) for values in signals.values()}
    assert len(lengths) == 1
    (count,) = lengths
    return [
        Sample(
            at=end - timedelta(seconds=every * (count - 1 - i)),
            **{name: values[i] for name, values in signals.items()},
        )
        for i in range(count)
    ]


def state(replicas, **kw):
    kw.setdefault("healthy", replicas)
    return ScalingState(replicas=replicas, **kw)


def test_the_briefs_example_burst_goes_up_with_the_figures():
    samples = series(in_flight=[6, 7, 37])
    decision = decide(POLICY, state(3), samples, NOW)
    assert (decision.direction, decision.desired) == (Direction.UP, 5)
    assert decision.reason == "in flight 37 over 3 replicas = 12.3 > target 8: up to 5"
    assert decision.signals == {"need": 5, "signal": "in_flight"}


def test_queued_requests_count_as_load():
    samples = series(in_flight=[16], queued=[9])
    decision = decide(POLICY, state(2), samples, NOW)
    assert (decision.direction, decision.desired) == (Direction.UP, 4)  # ceil(25 / 8)
    assert "in flight 16 + 9 queued over 2 replicas = 12.5 > target 8" in decision.reason


def test_burst_above_max_is_capped_and_says_so():
    decision = decide(POLICY, state(3), series(in_flight=[200]), NOW)
    assert (decision.direction, decision.desired) == (Direction.UP, 6)
    assert decision.reason.endswith("up to 6 (needs 25, max 6)")


def test_at_max_a_burst_holds():
    decision = decide(POLICY, state(6), series(in_flight=[200]), NOW)
    assert (decision.direction, decision.desired) == (Direction.HOLD, 6)
    assert "needs 25, at max 6" in decision.reason


def test_steady_load_holds():
    samples = series(in_flight=[15, 16, 14, 16, 15, 16, 16, 15, 14, 16, 16])  # 300 s
    decision = decide(POLICY, state(2), samples, NOW)
    assert (decision.direction, decision.desired) == (Direction.HOLD, 2)
    assert "steady at 2" in decision.reason


def test_a_spike_shorter_than_the_stabilisation_does_not_let_it_down():
    # 4 replicas were needed 2 minutes ago; the load fell since: the highest need of the
    # last 300 s still says 4, so no scale-down yet
    samples = series(in_flight=[8, 8, 8, 8, 8, 8, 30, 8, 8, 4, 4])
    decision = decide(POLICY, state(4), samples, NOW)
    assert (decision.direction, decision.desired) == (Direction.HOLD, 4)
    # once the spike is older than the stabilisation, the highest need is 1: down
    later = NOW + timedelta(seconds=200)
    samples += series(end=later, in_flight=[4, 4, 4, 4, 4, 4, 4])[1:]
    decision = decide(POLICY, state(4), samples, later)
    assert (decision.direction, decision.desired) == (Direction.DOWN, 1)
    assert decision.reason == "highest over the last 300 s: in flight 4 over 4 replicas = 1 < target 8: down to 1"


def test_scale_down_takes_the_highest_need_of_the_stabilisation():
    samples = series(in_flight=[20, 18, 17, 12, 10, 9, 8, 5, 3, 2, 1])
    decision = decide(POLICY, state(5), samples, NOW)
    assert (decision.direction, decision.desired) == (Direction.DOWN, 3)  # ceil(20 / 8)


def test_a_scale_up_needs_every_sample_of_its_stabilisation_to_ask():
    policy = ScalingPolicy(min_replicas=1, max_replicas=6, target_in_flight=8, scale_up_stabilisation_s=60)
    one_spike = series(in_flight=[8, 8, 40])
    held = decide(policy, state(2), one_spike, NOW)
    assert (held.direction, held.desired) == (Direction.HOLD, 2)
    assert held.reason == (
        "in flight 40 over 2 replicas = 20 > target 8: not sustained over the 60 s scale-up stabilisation "
        "(smallest need 1), hold at 2"
    )
    sustained = series(in_flight=[30, 40, 40])
    decision = decide(policy, state(2), sustained, NOW)
    assert (decision.direction, decision.desired) == (Direction.UP, 4)  # the smallest of the window: ceil(30 / 8)


def test_zero_traffic_goes_down_to_min_and_says_min():
    samples = series(in_flight=[0] * 11, queued=[0] * 11)
    decision = decide(POLICY, state(3), samples, NOW)
    assert (decision.direction, decision.desired) == (Direction.DOWN, 1)
    assert decision.reason.endswith("down to 1 (min 1)")


def test_zero_traffic_at_min_holds():
    policy = ScalingPolicy(min_replicas=2, max_replicas=6, target_in_flight=8)
    decision = decide(policy, state(2), series(in_flight=[0] * 11), NOW)
    assert (decision.direction, decision.desired) == (Direction.HOLD, 2)
    assert "at min 2" in decision.reason


def test_never_below_what_the_requests_in_flight_can_bear():
    # tokens/s says one replica is plenty; the 30 requests in flight need 3 at 10 each
    policy = ScalingPolicy(
        min_replicas=1,
        max_replicas=6,
        target_in_flight=None,
        target_tokens_per_s=1000,
        max_in_flight_per_replica=10,
    )
    samples = series(in_flight=[30] * 11, tokens_per_s=[200.0] * 11)
    decision = decide(policy, state(5), samples, NOW)
    assert (decision.direction, decision.desired) == (Direction.DOWN, 3)
    assert decision.reason.endswith("down to 3 (30 in flight need 3)")
    assert decision.signals["floor"] == 3
    # at the floor already: hold, saying why
    decision = decide(policy, state(3), samples, NOW)
    assert (decision.direction, decision.desired) == (Direction.HOLD, 3)
    assert "30 in flight need 3 replicas" in decision.reason


def test_gpu_utilisation_scales_from_the_healthy_replicas():
    policy = ScalingPolicy(min_replicas=1, max_replicas=8, target_in_flight=None, target_gpu_utilisation=60)
    decision = decide(policy, state(4, healthy=3, starting=1), series(gpu_utilisation=[95.0]), NOW)
    # 3 healthy × 95 % / 60 % = 4.75 → 5
    assert (decision.direction, decision.desired) == (Direction.UP, 5)
    assert decision.reason == "GPU 95% over 3 healthy replicas > target 60%: up to 5"


def test_the_largest_signal_wins():
    policy = ScalingPolicy(min_replicas=1, max_replicas=8, target_in_flight=8, target_tokens_per_s=500)
    decision = decide(policy, state(2), series(in_flight=[10], tokens_per_s=[2400.0]), NOW)
    assert (decision.direction, decision.desired, decision.signals["signal"]) == (Direction.UP, 5, "tokens_per_s")
    assert decision.reason.startswith("tokens/s 2400 over 2 replicas = 1200 > target 500")


# --- missing data --------------------------------------------------------------------------


def test_no_samples_at_all_hold():
    decision = decide(POLICY, state(3), [], NOW)
    assert (decision.direction, decision.desired) == (Direction.HOLD, 3)
    assert decision.reason == "no signal (last sample never): hold at 3"


def test_a_stale_last_sample_holds():
    samples = series(end=NOW - timedelta(seconds=91), in_flight=[0, 0])
    decision = decide(POLICY, state(3), samples, NOW)
    assert decision.direction == Direction.HOLD
    assert "last sample 91 s ago" in decision.reason


def test_samples_from_the_future_are_ignored():
    samples = series(in_flight=[4]) + [Sample(at=NOW + timedelta(seconds=5), in_flight=100)]
    decision = decide(POLICY, state(1), samples, NOW)
    assert decision.direction == Direction.HOLD


def test_a_last_sample_without_the_targeted_signal_holds():
    samples = series(in_flight=[20, 20, None], tokens_per_s=[1.0, 1.0, 900.0])
    decision = decide(POLICY, state(3), samples, NOW)
    assert (decision.direction, decision.desired) == (Direction.HOLD, 3)
    assert decision.reason == "no reading of in_flight in the last sample: hold at 3"


def test_missing_readings_inside_the_stabilisation_forbid_a_scale_down():
    values = [0, 0, 0, None, 0, 0, 0, 0, 0, 0, 0]
    decision = decide(POLICY, state(3), series(in_flight=values), NOW)
    assert (decision.direction, decision.desired) == (Direction.HOLD, 3)
    assert "missing in_flight readings in the last 300 s: no scale-down on missing data" in decision.reason


def test_a_missing_secondary_signal_also_forbids_a_scale_down():
    policy = ScalingPolicy(min_replicas=1, max_replicas=6, target_in_flight=8, target_gpu_utilisation=70)
    gpu = [10.0] * 10 + [None]
    decision = decide(policy, state(3), series(in_flight=[0] * 11, gpu_utilisation=gpu), NOW)
    assert decision.direction == Direction.HOLD
    assert "missing gpu_utilisation readings" in decision.reason


def test_a_missing_secondary_signal_does_not_stop_a_scale_up():
    policy = ScalingPolicy(min_replicas=1, max_replicas=6, target_in_flight=8, target_gpu_utilisation=70)
    decision = decide(policy, state(2), series(in_flight=[40], gpu_utilisation=[None]), NOW)
    assert (decision.direction, decision.desired) == (Direction.UP, 5)


def test_samples_that_do_not_reach_back_over_the_stabilisation_forbid_a_scale_down():
    # the gateway has reported for 2 minutes only (a restart): not enough to go down
    decision = decide(POLICY, state(3), series(in_flight=[0, 0, 0, 0, 0]), NOW)
    assert decision.direction == Direction.HOLD
    assert "samples reach back 120 s of the 300 s stabilisation" in decision.reason


def test_a_gap_in_the_samples_forbids_a_scale_down():
    samples = series(in_flight=[0] * 11)
    del samples[3:7]  # 150 s without a sample
    decision = decide(POLICY, state(3), samples, NOW)
    assert decision.direction == Direction.HOLD
    assert "no sample for 150 s" in decision.reason


# --- cooldowns -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seconds_since,expected",
    [(59, Direction.HOLD), (60, Direction.UP), (61, Direction.UP)],
)
def test_scale_up_cooldown_boundary(seconds_since, expected):
    last = state(3, last_change_at=NOW - timedelta(seconds=seconds_since), last_direction=Direction.UP)
    decision = decide(POLICY, last, series(in_flight=[40]), NOW)
    assert decision.direction == expected
    if expected == Direction.HOLD:
        assert "the last scale-up was 59 s ago (cooldown 60 s)" in decision.reason


def test_a_scale_down_does_not_hold_back_a_scale_up():
    last = state(2, last_change_at=NOW - timedelta(seconds=10), last_direction=Direction.DOWN)
    decision = decide(POLICY, last, series(in_flight=[40]), NOW)
    assert (decision.direction, decision.desired) == (Direction.UP, 5)


@pytest.mark.parametrize(
    "seconds_since,direction_before,expected",
    [
        (299, Direction.DOWN, Direction.HOLD),
        (300, Direction.DOWN, Direction.DOWN),
        (299, Direction.UP, Direction.HOLD),  # a scale-down right after a scale-up is flapping
        (300, Direction.UP, Direction.DOWN),
    ],
)
def test_scale_down_cooldown_boundary(seconds_since, direction_before, expected):
    last = state(4, last_change_at=NOW - timedelta(seconds=seconds_since), last_direction=direction_before)
    decision = decide(POLICY, last, series(in_flight=[0] * 11), NOW)
    assert decision.direction == expected
    if expected == Direction.HOLD:
        assert "would go down to 1, but the last change was 299 s ago (cooldown 300 s)" in decision.reason


# --- bounds, sleeping, windows -------------------------------------------------------------


def test_below_min_goes_up_at_once_even_in_cooldown_and_without_signals():
    last = state(0, last_change_at=NOW, last_direction=Direction.UP)
    decision = decide(ScalingPolicy(min_replicas=2, max_replicas=4), last, [], NOW)
    assert (decision.direction, decision.desired) == (Direction.UP, 2)
    assert decision.reason == "0 replicas is below min 2: up to 2"


def test_above_max_goes_down_at_once():
    decision = decide(POLICY, state(9), series(in_flight=[100]), NOW)
    assert (decision.direction, decision.desired) == (Direction.DOWN, 6)


def test_a_sleeping_service_gets_no_decision():
    decision = decide(POLICY, state(2, sleeping=True), series(in_flight=[100]), NOW)
    assert (decision.direction, decision.desired, decision.changes) == (Direction.SKIP, 2, False)
    assert "sleeping" in decision.reason


def test_a_window_holding_the_count_skips_the_service():
    decision = decide(POLICY, state(1, window_holds=True), series(in_flight=[100]), NOW)
    assert (decision.direction, decision.desired) == (Direction.SKIP, 1)
    assert decision.reason == "a scheduling window holds the replica count"


# --- validation ----------------------------------------------------------------------------


def test_a_good_policy_is_valid():
    assert validate_policy(POLICY) == []


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"min_replicas": 0}, "min_replicas must be an integer of at least 1"),
        ({"max_replicas": 0}, "max_replicas must be an integer of at least 1"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas (2) is below min_replicas (3)"),
        ({"target_in_flight": None}, "set at least one target"),
        ({"target_in_flight": 0}, "target_in_flight must be above 0"),
        ({"target_gpu_utilisation": 120}, "target_gpu_utilisation must be a percentage"),
        ({"scale_down_cooldown_s": -1}, "scale_down_cooldown_s must not be negative"),
        ({"max_sample_age_s": 0}, "max_sample_age_s must be above 0"),
    ],
)
def test_bad_policies_are_named(changes, fragment):
    fields = {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_in_flight": 8,
        **changes,
    }
    errors = validate_policy(ScalingPolicy(**fields))
    assert any(fragment in error for error in errors), errors


def test_a_policy_parses_from_its_json_form_with_defaults_for_the_rest():
    policy = parse_policy({"min_replicas": 2, "max_replicas": 5, "target_in_flight": None, "target_tokens_per_s": 900})
    assert (policy.min_replicas, policy.max_replicas, policy.target_in_flight, policy.target_tokens_per_s) == (
        2,
        5,
        None,
        900,
    )
    assert policy.scale_down_stabilisation_s == 300


@pytest.mark.parametrize(
    "data,expected",
    [
        ([], ["an autoscaling policy must be an object"]),
        ({"max_replicas": 2, "cooldown": 5}, ["unknown fields: cooldown"]),
        ({"max_replicas": "2"}, ["max_replicas must be an integer"]),
        ({"max_replicas": 2.5}, ["max_replicas must be an integer"]),
        ({"max_replicas": True}, ["max_replicas must be an integer"]),
        ({"max_replicas": 2, "target_in_flight": "8"}, ["target_in_flight must be a number or null"]),
        ({"max_replicas": 2, "scale_up_cooldown_s": None}, ["scale_up_cooldown_s must be a number"]),
        ({"min_replicas": 3, "max_replicas": 2}, ["max_replicas (2) is below min_replicas (3)"]),
    ],
)
def test_a_bad_json_policy_names_every_problem(data, expected):
    with pytest.raises(PolicyError) as caught:
        parse_policy(data)
    assert caught.value.errors == expected
