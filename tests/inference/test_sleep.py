"""An inference service's state machine, sleep on idle, the wake's time-out and the wake
queue's rule (apps/inference/sleep.py): every legal move, every illegal one."""

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from apps.inference.sleep import (
    Effect,
    Event,
    IllegalTransition,
    NodeHealth,
    ServiceState,
    SleepPolicy,
    WakeStep,
    WakingReplica,
    allowed,
    decide_idle,
    decide_wake_timeout,
    transition,
    validate_sleep_policy,
    wake_step,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

# Written out here rather than read from the module, so a change to the table is a
# change to this test too: (state, event) → (new state, effects).
LEGAL = {
    ("starting", "healthy"): ("running", ()),
    ("starting", "unhealthy"): ("starting", ()),
    ("starting", "wake"): ("starting", ()),
    ("starting", "pause"): ("paused", ("pause_replicas",)),
    ("starting", "stop"): ("stopping", ("stop_replicas",)),
    ("running", "healthy"): ("running", ()),
    ("running", "unhealthy"): ("starting", ()),
    ("running", "idle"): ("sleeping", ("sleep_replicas",)),
    ("running", "wake"): ("running", ()),
    ("running", "pause"): ("paused", ("pause_replicas",)),
    ("running", "stop"): ("stopping", ("stop_replicas",)),
    ("sleeping", "wake"): ("waking", ("wake_replicas",)),
    ("sleeping", "stop"): ("stopping", ("stop_replicas",)),
    ("waking", "healthy"): ("running", ()),
    ("waking", "wake"): ("waking", ()),
    ("waking", "wake_timed_out"): ("sleeping", ("sleep_replicas", "raise_alert")),
    ("waking", "stop"): ("stopping", ("stop_replicas",)),
    ("paused", "resume"): ("starting", ("resume_replicas",)),
    ("paused", "stop"): ("stopping", ("stop_replicas",)),
    ("stopping", "stop"): ("stopping", ()),
    ("stopping", "ended"): ("stopped", ()),
}
ALL_PAIRS = list(itertools.product([s.value for s in ServiceState], [e.value for e in Event]))
ILLEGAL = [pair for pair in ALL_PAIRS if pair not in LEGAL]


def test_the_table_covers_the_states_and_events_written_here():
    assert {s.value for s in ServiceState} == {
        "starting",
        "running",
        "sleeping",
        "waking",
        "paused",
        "stopping",
        "stopped",
    }
    assert len(ALL_PAIRS) == 63 and len(ILLEGAL) == 63 - len(LEGAL)


@pytest.mark.parametrize("state,event", sorted(LEGAL))
def test_every_legal_transition(state, event):
    target, effects = LEGAL[state, event]
    move = transition(ServiceState(state), Event(event))
    assert (move.source, move.event, move.target) == (state, event, target)
    assert move.effects == tuple(Effect(effect) for effect in effects)
    assert move.changed is (state != target or bool(effects))
    assert allowed(ServiceState(state), Event(event))


@pytest.mark.parametrize("state,event", ILLEGAL)
def test_every_illegal_transition_is_refused(state, event):
    assert not allowed(ServiceState(state), Event(event))
    with pytest.raises(IllegalTransition) as caught:
        transition(ServiceState(state), Event(event))
    assert caught.value.state == state and caught.value.event == event
    assert str(caught.value).startswith(f"a {state} service cannot take {event}")


def test_the_refusal_names_what_the_state_takes():
    with pytest.raises(IllegalTransition, match=r"a paused service cannot take wake \(it takes: resume, stop\)"):
        transition(ServiceState.PAUSED, Event.WAKE)
    with pytest.raises(IllegalTransition, match=r"it takes: none"):
        transition(ServiceState.STOPPED, Event.STOP)


def test_plain_strings_are_accepted_and_unknown_ones_refused():
    assert transition("sleeping", "wake").target == ServiceState.WAKING
    with pytest.raises(ValueError):
        transition("asleep", "wake")


def test_the_sleep_and_wake_round_trip():
    state = ServiceState.RUNNING
    path = []
    for event in (Event.IDLE, Event.WAKE, Event.WAKE, Event.HEALTHY):
        move = transition(state, event)
        path.append((move.target, move.effects))
        state = move.target
    assert path == [
        (ServiceState.SLEEPING, (Effect.SLEEP_REPLICAS,)),
        (ServiceState.WAKING, (Effect.WAKE_REPLICAS,)),
        (ServiceState.WAKING, ()),  # the second request while waking wakes nothing more
        (ServiceState.RUNNING, ()),
    ]


# --- idle and the wake's time-out ----------------------------------------------------------

POLICY = SleepPolicy(sleep_after_s=600)
UP_SINCE = NOW - timedelta(hours=2)


@pytest.mark.parametrize(
    "idle_s,expected",
    [(599, False), (600, True), (601, True)],
)
def test_idle_for_sleep_after_sleeps_at_the_boundary(idle_s, expected):
    verdict = decide_idle(
        POLICY,
        ServiceState.RUNNING,
        running_since=UP_SINCE,
        last_request_at=NOW - timedelta(seconds=idle_s),
        in_flight=0,
        now=NOW,
    )
    assert verdict.yes is expected
    assert (f"idle {idle_s} s" in verdict.reason) and ("sleep_after 600 s" in verdict.reason)


def test_a_service_just_up_or_just_woken_is_not_idle():
    # its last request was long ago, but it has been running for 5 minutes only
    verdict = decide_idle(
        POLICY,
        ServiceState.RUNNING,
        running_since=NOW - timedelta(minutes=5),
        last_request_at=NOW - timedelta(days=1),
        in_flight=0,
        now=NOW,
    )
    assert not verdict.yes and verdict.reason == "idle 300 s < sleep_after 600 s"
    never_called = decide_idle(
        POLICY, ServiceState.RUNNING, running_since=NOW - timedelta(minutes=11), last_request_at=None, in_flight=0,
        now=NOW,
    )  # fmt: skip
    assert never_called.yes and "running since" in never_called.reason


def test_a_request_in_flight_keeps_it_awake():
    verdict = decide_idle(
        POLICY, ServiceState.RUNNING, running_since=UP_SINCE, last_request_at=UP_SINCE, in_flight=1, now=NOW
    )
    assert not verdict.yes and verdict.reason == "1 requests in flight"


def test_no_in_flight_reading_keeps_it_awake():
    verdict = decide_idle(
        POLICY, ServiceState.RUNNING, running_since=UP_SINCE, last_request_at=UP_SINCE, in_flight=None, now=NOW
    )
    assert not verdict.yes and "no in-flight reading" in verdict.reason


@pytest.mark.parametrize("state", [s for s in ServiceState if s != ServiceState.RUNNING])
def test_only_a_running_service_sleeps(state):
    verdict = decide_idle(POLICY, state, running_since=UP_SINCE, last_request_at=UP_SINCE, in_flight=0, now=NOW)
    assert not verdict.yes


def test_no_sleep_policy_never_sleeps():
    verdict = decide_idle(
        SleepPolicy(), ServiceState.RUNNING, running_since=UP_SINCE, last_request_at=None, in_flight=0, now=NOW
    )
    assert not verdict.yes and verdict.reason == "no sleep policy"


@pytest.mark.parametrize("waited_s,expected", [(599, False), (600, True)])
def test_the_wake_times_out_at_its_boundary(waited_s, expected):
    verdict = decide_wake_timeout(POLICY, ServiceState.WAKING, waking_since=NOW - timedelta(seconds=waited_s), now=NOW)
    assert verdict.yes is expected
    assert not decide_wake_timeout(POLICY, ServiceState.RUNNING, waking_since=UP_SINCE, now=NOW).yes


def test_sleep_policy_validation():
    assert validate_sleep_policy(POLICY) == []
    assert validate_sleep_policy(SleepPolicy()) == []
    assert validate_sleep_policy(SleepPolicy(sleep_after_s=10)) == [
        "sleep_after_s must be at least 60 (or null: never sleep)"
    ]
    assert validate_sleep_policy(SleepPolicy(sleep_after_s=600, wake_timeout_s=0)) == ["wake_timeout_s must be above 0"]


# --- the wake queue ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "node,step,reason",
    [
        (NodeHealth.ALIVE, WakeStep.START_IN_PLACE, "node n1 is alive: started in place"),
        (NodeHealth.DEAD, WakeStep.MOVE, "node n1 is dead: moved and rebuilt"),
        (NodeHealth.UNKNOWN, WakeStep.WAIT, "node n1 could not be read this round: left alone"),
    ],
)
def test_the_wake_queue_rule(node, step, reason):
    decision = wake_step(WakingReplica(task_id=7, node_id="n1", node=node))
    assert (decision.task_id, decision.step, decision.reason) == (7, step, reason)


def test_a_waking_replica_off_any_node_is_placed():
    decision = wake_step(WakingReplica(task_id=7, node_id=None, node=NodeHealth.DEAD))
    assert decision.step == WakeStep.PLACE


def test_an_unknown_node_round_then_a_dead_one():
    # the same replica over three rounds: a read failure leaves it; the node judged dead moves it
    rounds = [NodeHealth.UNKNOWN, NodeHealth.UNKNOWN, NodeHealth.DEAD]
    steps = [wake_step(WakingReplica(1, "n1", node)).step for node in rounds]
    assert steps == [WakeStep.WAIT, WakeStep.WAIT, WakeStep.MOVE]


def test_the_stored_states_are_the_state_machines():
    from apps.inference.choices import ServiceStatus

    assert set(ServiceStatus.values) == {state.value for state in ServiceState}
