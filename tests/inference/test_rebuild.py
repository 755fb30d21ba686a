"""The rebuild decision (apps/inference/rebuild.py): died replicas recreated, lost nodes'
replicas moved, unreadable nodes left alone, crash loops backed off and alerted."""

from datetime import UTC, datetime, timedelta

import pytest

from apps.inference.rebuild import (
    RebuildKind,
    RebuildPolicy,
    ReplicaHealth,
    ReplicaSlot,
    backoff_s,
    plan,
)
from apps.inference.sleep import NodeHealth, ServiceState

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
POLICY = RebuildPolicy(backoff_base_s=10, backoff_cap_s=300, crash_window_s=600, alert_after=5)


def ago(seconds):
    return NOW - timedelta(seconds=seconds)


def healthy(rank, **kw):
    return ReplicaSlot(rank, ReplicaHealth.HEALTHY, node_id=f"n{rank}", **kw)


def died(rank, at=NOW, restarts=(), **kw):
    return ReplicaSlot(rank, ReplicaHealth.DIED, node_id=f"n{rank}", died_at=at, restarts=tuple(restarts), **kw)


def one(slot, replicas=1, now=NOW, state=ServiceState.RUNNING):
    (action,) = plan(state, replicas, [slot], POLICY, now)
    return action


@pytest.mark.parametrize(
    "state", [ServiceState.SLEEPING, ServiceState.WAKING, ServiceState.PAUSED, ServiceState.STOPPING, "stopped"]
)
def test_a_service_not_starting_or_running_is_not_rebuilt(state):
    assert plan(state, 2, [died(0)], POLICY, NOW) == []


def test_healthy_starting_and_pending_replicas_are_kept():
    slots = [healthy(0), ReplicaSlot(1, ReplicaHealth.STARTING), ReplicaSlot(2, ReplicaHealth.PENDING)]
    actions = plan(ServiceState.STARTING, 3, slots, POLICY, NOW)
    assert [action.kind for action in actions] == [RebuildKind.KEEP] * 3


def test_a_first_death_is_recreated_at_once():
    action = one(died(0))
    assert (action.kind, action.counts_as_restart, action.alert) == (RebuildKind.RECREATE, True, False)
    assert action.reason == "died, 0 restarts in the last 600 s: recreated"


def test_a_second_death_waits_for_its_back_off():
    slot = died(0, at=ago(9), restarts=[ago(60)])
    waiting = one(slot)
    assert (waiting.kind, waiting.not_before) == (RebuildKind.BACK_OFF, ago(9) + timedelta(seconds=10))
    assert waiting.reason == "died, 1 restarts in the last 600 s: backing off 10 s"
    assert not waiting.counts_as_restart
    # exactly at the end of the back-off: recreated
    ready = one(slot, now=NOW + timedelta(seconds=1))
    assert (ready.kind, ready.counts_as_restart) == (RebuildKind.RECREATE, True)
    assert ready.reason.endswith("recreated, after 10 s back-off")


@pytest.mark.parametrize("recent,expected", [(0, 0), (1, 10), (2, 20), (3, 40), (4, 80), (5, 160), (6, 300), (9, 300)])
def test_the_back_off_doubles_up_to_its_cap(recent, expected):
    assert backoff_s(POLICY, recent) == expected


def test_restarts_older_than_the_crash_window_do_not_count():
    # a replica that ran for an hour between its crashes is not crash-looping
    slot = died(0, restarts=[ago(600), ago(3600), ago(7200)])
    action = one(slot)
    assert (action.kind, action.alert) == (RebuildKind.RECREATE, False)
    assert "0 restarts" in action.reason


def test_a_crash_loop_raises_the_alert_once_and_keeps_backing_off():
    restarts = [ago(s) for s in (500, 400, 300, 200, 100)]
    looping = one(died(0, at=ago(30), restarts=restarts))
    assert (looping.kind, looping.alert) == (RebuildKind.BACK_OFF, True)
    assert looping.not_before == ago(30) + timedelta(seconds=160)
    # the alert is open already: not raised again
    again = one(died(0, at=ago(30), restarts=restarts, alert_open=True))
    assert (again.kind, again.alert) == (RebuildKind.BACK_OFF, False)
    # one restart fewer: no alert
    assert not one(died(0, at=ago(30), restarts=restarts[1:])).alert


def test_a_replica_on_a_dead_node_is_recreated_elsewhere_without_counting_a_crash():
    slot = ReplicaSlot(0, ReplicaHealth.HEALTHY, node=NodeHealth.DEAD, node_id="gpu-7", restarts=(ago(5),) * 6)
    action = one(slot)
    assert (action.kind, action.avoid_node, action.counts_as_restart, action.alert) == (
        RebuildKind.RECREATE_ELSEWHERE,
        "gpu-7",
        False,
        False,
    )
    assert action.reason == "node gpu-7 is dead: recreated elsewhere"


def test_a_replica_on_a_node_not_read_this_round_is_left_alone():
    for health in (ReplicaHealth.HEALTHY, ReplicaHealth.STARTING):
        slot = ReplicaSlot(0, health, node=NodeHealth.UNKNOWN, node_id="gpu-7")
        action = one(slot)
        assert (action.kind, action.reason) == (
            RebuildKind.LEAVE,
            "node gpu-7 could not be read this round: left alone",
        )


def test_a_reported_death_is_recreated_even_when_its_node_is_not_read():
    assert one(died(0, node=NodeHealth.UNKNOWN)).kind == RebuildKind.RECREATE


def test_missing_ranks_below_the_count_are_created():
    actions = plan(ServiceState.RUNNING, 4, [healthy(0), healthy(2)], POLICY, NOW)
    assert [(action.rank, action.kind) for action in actions] == [
        (0, RebuildKind.KEEP),
        (1, RebuildKind.CREATE),
        (2, RebuildKind.KEEP),
        (3, RebuildKind.CREATE),
    ]


def test_dead_slots_above_the_count_are_not_recreated():
    slots = [healthy(0), died(1), ReplicaSlot(2, ReplicaHealth.HEALTHY, node=NodeHealth.DEAD, node_id="n2")]
    actions = plan(ServiceState.RUNNING, 1, slots, POLICY, NOW)
    assert [(action.rank, action.kind) for action in actions] == [
        (0, RebuildKind.KEEP),
        (1, RebuildKind.LEAVE),
        (2, RebuildKind.LEAVE),
    ]


def test_two_slots_with_one_rank_are_refused():
    with pytest.raises(ValueError, match="share a rank"):
        plan(ServiceState.RUNNING, 2, [healthy(0), died(0)], POLICY, NOW)


def test_a_mixed_service_gets_one_action_per_slot_in_rank_order():
    slots = [
        died(3, at=ago(5), restarts=[ago(50), ago(40)]),  # backing off 20 s
        ReplicaSlot(1, ReplicaHealth.HEALTHY, node=NodeHealth.DEAD, node_id="n1"),
        healthy(0),
        died(2),
    ]
    actions = plan(ServiceState.RUNNING, 4, slots, POLICY, NOW)
    assert [(action.rank, action.kind) for action in actions] == [
        (0, RebuildKind.KEEP),
        (1, RebuildKind.RECREATE_ELSEWHERE),
        (2, RebuildKind.RECREATE),
        (3, RebuildKind.BACK_OFF),
    ]
    assert actions[3].not_before == ago(5) + timedelta(seconds=20)
