"""An inference service's states and the moves between them, sleep on idle, and the wake
queue's rule. Pure: states and events in, the new state and what must follow out; the time
is passed in. The services apply the effects (replica tasks moved through
`apps.tasks.services` with CAS) in the same transaction as the service's new state.

    starting ──healthy──▶ running ──idle──▶ sleeping ──wake──▶ waking ──healthy──▶ running
       ▲                  │   ▲                                  │
       └────unhealthy─────┘   └──────────────(waking) wake timed out → sleeping
    starting/running ──pause──▶ paused ──resume──▶ starting
    any but stopped ──stop──▶ stopping ──stopped──▶ stopped

Every (state, event) pair not in TRANSITIONS is illegal and raises IllegalTransition;
a few pairs are allowed and change nothing (a wake of a service already waking), so a
retried request or a second job is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum


class ServiceState(StrEnum):
    STARTING = "starting"  # replicas placed or starting, none healthy (yet, or any more)
    RUNNING = "running"  # at least one replica answers its health probe
    SLEEPING = "sleeping"  # idle: replicas stopped (containers kept), cards freed
    WAKING = "waking"  # woken: replicas starting again, none healthy yet
    PAUSED = "paused"  # a scheduling window paused it
    STOPPING = "stopping"  # stopped by a user or a window; replicas ending
    STOPPED = "stopped"  # every replica ended (terminal)


class Event(StrEnum):
    HEALTHY = "healthy"  # a replica answers its health probe
    UNHEALTHY = "unhealthy"  # no replica answers any more
    IDLE = "idle"  # no request for sleep_after (decide_idle)
    WAKE = "wake"  # the first request through the gateway, or POST …/wake
    WAKE_TIMED_OUT = "wake_timed_out"  # waking for longer than wake_timeout (decide_wake_timeout)
    PAUSE = "pause"  # a scheduling window's pause
    RESUME = "resume"  # back inside the window
    STOP = "stop"  # a user's stop, or a window's
    ENDED = "ended"  # every replica has ended


class Effect(StrEnum):
    SLEEP_REPLICAS = "sleep_replicas"  # running → sleeping: containers stopped and kept, cards freed
    WAKE_REPLICAS = "wake_replicas"  # sleeping → waking: the wake queue starts them (wake_step)
    PAUSE_REPLICAS = "pause_replicas"  # running → paused
    RESUME_REPLICAS = "resume_replicas"  # paused → running (the agent starts them again)
    STOP_REPLICAS = "stop_replicas"  # every replica to stopping
    RAISE_ALERT = "raise_alert"  # an operator should hear of it (a wake that timed out)


S, E, F = ServiceState, Event, Effect

# state → event → (new state, effects). Pairs that keep the state and have no effect are
# the idempotent ones.
TRANSITIONS: dict[ServiceState, dict[Event, tuple[ServiceState, tuple[Effect, ...]]]] = {
    S.STARTING: {
        E.HEALTHY: (S.RUNNING, ()),
        E.UNHEALTHY: (S.STARTING, ()),
        E.WAKE: (S.STARTING, ()),  # coming up already
        E.PAUSE: (S.PAUSED, (F.PAUSE_REPLICAS,)),
        E.STOP: (S.STOPPING, (F.STOP_REPLICAS,)),
    },
    S.RUNNING: {
        E.HEALTHY: (S.RUNNING, ()),
        E.UNHEALTHY: (S.STARTING, ()),
        E.IDLE: (S.SLEEPING, (F.SLEEP_REPLICAS,)),
        E.WAKE: (S.RUNNING, ()),  # awake already
        E.PAUSE: (S.PAUSED, (F.PAUSE_REPLICAS,)),
        E.STOP: (S.STOPPING, (F.STOP_REPLICAS,)),
    },
    S.SLEEPING: {
        E.WAKE: (S.WAKING, (F.WAKE_REPLICAS,)),
        E.STOP: (S.STOPPING, (F.STOP_REPLICAS,)),
    },
    S.WAKING: {
        E.HEALTHY: (S.RUNNING, ()),
        E.WAKE: (S.WAKING, ()),  # a second request while it wakes
        E.WAKE_TIMED_OUT: (S.SLEEPING, (F.SLEEP_REPLICAS, F.RAISE_ALERT)),
        E.STOP: (S.STOPPING, (F.STOP_REPLICAS,)),
    },
    S.PAUSED: {
        E.RESUME: (S.STARTING, (F.RESUME_REPLICAS,)),
        E.STOP: (S.STOPPING, (F.STOP_REPLICAS,)),
    },
    S.STOPPING: {
        E.STOP: (S.STOPPING, ()),
        E.ENDED: (S.STOPPED, ()),
    },
    S.STOPPED: {},
}


class IllegalTransition(ValueError):
    def __init__(self, state: ServiceState, event: Event):
        allowed = ", ".join(TRANSITIONS[state]) or "none"
        super().__init__(f"a {state} service cannot take {event} (it takes: {allowed})")
        self.state, self.event = state, event


@dataclass(frozen=True)
class Transition:
    source: ServiceState
    event: Event
    target: ServiceState
    effects: tuple[Effect, ...]

    @property
    def changed(self) -> bool:
        return self.source != self.target or bool(self.effects)


def allowed(state: ServiceState, event: Event) -> bool:
    return event in TRANSITIONS[state]


def transition(state: ServiceState, event: Event) -> Transition:
    """The move `event` makes from `state`, or IllegalTransition."""
    state, event = ServiceState(state), Event(event)
    if event not in TRANSITIONS[state]:
        raise IllegalTransition(state, event)
    target, effects = TRANSITIONS[state][event]
    return Transition(state, event, target, effects)


# --- sleep on idle, and the wake's time-out ------------------------------------------------


@dataclass(frozen=True)
class SleepPolicy:
    sleep_after_s: float | None = None  # None: never sleeps
    wake_timeout_s: float = 600.0  # waking this long with no healthy replica: back to sleep, alert


@dataclass(frozen=True)
class Verdict:
    yes: bool
    reason: str


def validate_sleep_policy(policy: SleepPolicy) -> list[str]:
    errors = []
    if policy.sleep_after_s is not None and not policy.sleep_after_s >= 60:
        errors.append("sleep_after_s must be at least 60 (or null: never sleep)")
    if not policy.wake_timeout_s > 0:
        errors.append("wake_timeout_s must be above 0")
    return errors


def decide_idle(
    policy: SleepPolicy,
    state: ServiceState,
    *,
    running_since: datetime,
    last_request_at: datetime | None,
    in_flight: int | None,
    now: datetime,
) -> Verdict:
    """Whether a service goes to sleep now. Idle time counts from the later of its last
    request and the moment it became running (a service just up, or just woken, is not
    idle); a request in flight, or an in-flight count the gateway did not give, keeps it
    awake (no sleep on missing data)."""
    if policy.sleep_after_s is None:
        return Verdict(False, "no sleep policy")
    if state != ServiceState.RUNNING:
        return Verdict(False, f"{state}: only a running service sleeps")
    if in_flight is None:
        return Verdict(False, "no in-flight reading from the gateway: stays awake")
    if in_flight > 0:
        return Verdict(False, f"{in_flight} requests in flight")
    since = max(running_since, last_request_at) if last_request_at else running_since
    idle = (now - since).total_seconds()
    what = "last request" if last_request_at and last_request_at >= running_since else "running since"
    if idle >= policy.sleep_after_s:
        return Verdict(
            True, f"idle {idle:.0f} s ({what} {since:%Y-%m-%d %H:%M:%S}) ≥ sleep_after {policy.sleep_after_s:.0f} s"
        )
    return Verdict(False, f"idle {idle:.0f} s < sleep_after {policy.sleep_after_s:.0f} s")


def decide_wake_timeout(policy: SleepPolicy, state: ServiceState, *, waking_since: datetime, now: datetime) -> Verdict:
    if state != ServiceState.WAKING:
        return Verdict(False, f"{state}: not waking")
    waited = (now - waking_since).total_seconds()
    if waited >= policy.wake_timeout_s:
        timeout = policy.wake_timeout_s
        return Verdict(True, f"waking for {waited:.0f} s with no healthy replica (timeout {timeout:.0f} s)")
    return Verdict(False, f"waking for {waited:.0f} s")


# --- the wake queue (15 s) -----------------------------------------------------------------


class NodeHealth(StrEnum):
    """What this round could read of a node: alive, judged dead (silent past the give-up
    time, or gone), or unknown (its state could not be read this round)."""

    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


class WakeStep(StrEnum):
    START_IN_PLACE = "start_in_place"  # the agent starts the kept container again
    MOVE = "move"  # its node is dead: back to the queue, rebuilt elsewhere
    PLACE = "place"  # not on a node: the scheduler places it
    WAIT = "wait"  # its node cannot be read this round: left alone


@dataclass(frozen=True)
class WakingReplica:
    task_id: int
    node_id: str | None
    node: NodeHealth = NodeHealth.UNKNOWN  # ignored when node_id is None


@dataclass(frozen=True)
class WakeDecision:
    task_id: int
    step: WakeStep
    reason: str


def wake_step(replica: WakingReplica) -> WakeDecision:
    """The wake queue's rule for one waking replica: a node judged dead has its instance
    moved and rebuilt; a node whose state cannot be read this round is left alone (no
    needless rebuild of a healthy instance); an alive node starts it in place."""
    if replica.node_id is None:
        return WakeDecision(replica.task_id, WakeStep.PLACE, "not on a node: placed by the scheduler")
    node = NodeHealth(replica.node)
    if node == NodeHealth.DEAD:
        return WakeDecision(replica.task_id, WakeStep.MOVE, f"node {replica.node_id} is dead: moved and rebuilt")
    if node == NodeHealth.UNKNOWN:
        return WakeDecision(
            replica.task_id, WakeStep.WAIT, f"node {replica.node_id} could not be read this round: left alone"
        )
    return WakeDecision(replica.task_id, WakeStep.START_IN_PLACE, f"node {replica.node_id} is alive: started in place")
