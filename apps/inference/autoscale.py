"""The AutoScaler's decision (the 30 s job): a service's policy, its replica counts, its
last decision and a series of signal samples in; a desired count, a direction and a
reason in words with the figures out. No database, no clock, no Django: the job loads the
inputs, calls `decide`, and records the decision (and applies it through the services).

The rules (docs/inference.md, Autoscaling):
- a sleeping service, or one whose count a scheduling window holds, gets no decision
  (direction `skip`, with the reason);
- each sample's need is the largest of its signals' needs: requests in flight plus queued
  over the in-flight target, tokens/s over the tokens/s target, and GPU utilisation
  scaled from the healthy replicas to the utilisation target (a signal without a target
  is not used; a missing reading gives no need);
- up: the smallest need over the scale-up stabilisation (the latest sample alone by
  default), once the last scale-up's cooldown has passed;
- down: the largest need over the scale-down stabilisation, only when every sample in it
  has every targeted signal and the samples reach back over the whole stabilisation, once
  the last change's cooldown has passed; and never below what the requests in flight now
  can bear;
- always between min and max; a count outside them is brought back at once (the policy
  is the operator's word, not a load reading).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum


class Direction(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"  # evaluated, count unchanged
    SKIP = "skip"  # not evaluated (sleeping, held by a window)


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int = 1
    max_replicas: int = 1
    target_in_flight: float | None = 8.0  # requests in flight + queued per replica
    target_tokens_per_s: float | None = None  # generated tokens/s per replica
    target_gpu_utilisation: float | None = None  # percent, 0-100, mean over the replicas' cards
    # the most requests one replica can carry at once (the engine's concurrency); the floor
    # under a scale-down. None: the in-flight target.
    max_in_flight_per_replica: float | None = None
    scale_up_cooldown_s: float = 60.0
    scale_down_cooldown_s: float = 300.0
    scale_up_stabilisation_s: float = 0.0  # 0: the latest sample alone decides an up-scale
    scale_down_stabilisation_s: float = 300.0
    max_sample_age_s: float = 90.0  # a latest sample older than this is no signal

    @property
    def capacity_per_replica(self) -> float | None:
        return self.max_in_flight_per_replica or self.target_in_flight


@dataclass(frozen=True)
class Sample:
    """One reading: the gateway's counts and tokens/s, the heartbeats' GPU utilisation
    (mean over the healthy replicas' cards). None: not read this time (never zero)."""

    at: datetime
    in_flight: int | None = None
    queued: int | None = None
    tokens_per_s: float | None = None
    gpu_utilisation: float | None = None


@dataclass(frozen=True)
class ScalingState:
    replicas: int  # the service's current replica count (what it asks for)
    healthy: int = 0  # of them, answering their health probe
    starting: int = 0  # of them, placed or starting, not yet healthy
    last_change_at: datetime | None = None  # the last decision that changed the count
    last_direction: Direction | None = None  # its direction (up or down)
    sleeping: bool = False
    window_holds: bool = False  # a scheduling window holds the count (outside the window)


@dataclass(frozen=True)
class Need:
    """What one sample asks for: replicas, and the sentence saying why."""

    replicas: int
    at: datetime
    signal: str  # in_flight | tokens_per_s | gpu_utilisation
    figures: str  # "in flight 37 over 3 replicas = 12.3 > target 8"


@dataclass(frozen=True)
class ScaleDecision:
    direction: Direction
    current: int
    desired: int  # == current for hold and skip
    reason: str
    signals: dict = field(default_factory=dict)  # the figures, for the decision record

    @property
    def changes(self) -> bool:
        return self.direction in (Direction.UP, Direction.DOWN)


POLICY_FIELDS = {
    "min_replicas",
    "max_replicas",
    "target_in_flight",
    "target_tokens_per_s",
    "target_gpu_utilisation",
    "max_in_flight_per_replica",
    "scale_up_cooldown_s",
    "scale_down_cooldown_s",
    "scale_up_stabilisation_s",
    "scale_down_stabilisation_s",
    "max_sample_age_s",
}


class PolicyError(ValueError):
    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


def parse_policy(data: Mapping) -> ScalingPolicy:
    """A policy from its JSON form (the fields of ScalingPolicy; those left out keep their
    defaults), or PolicyError listing every problem: unknown fields, values that are not
    numbers, and what `validate_policy` finds."""
    if not isinstance(data, Mapping):
        raise PolicyError(["an autoscaling policy must be an object"])
    errors = []
    unknown = sorted(set(data) - POLICY_FIELDS)
    if unknown:
        errors.append(f"unknown fields: {', '.join(unknown)}")
    values = {}
    for name in sorted(POLICY_FIELDS & set(data)):
        value = data[name]
        integral = name in ("min_replicas", "max_replicas")
        nullable = name.startswith("target_") or name == "max_in_flight_per_replica"
        if value is None and nullable:
            values[name] = None
        elif isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            errors.append(f"{name} must be {'an integer' if integral else 'a number'}{' or null' if nullable else ''}")
        else:
            values[name] = value
    if errors:
        raise PolicyError(errors)
    policy = ScalingPolicy(**values)
    errors = validate_policy(policy)
    if errors:
        raise PolicyError(errors)
    return policy


def validate_policy(policy: ScalingPolicy) -> list[str]:
    """Every problem with a policy, in words (empty: valid), for the API to return."""
    errors = []
    if not isinstance(policy.min_replicas, int) or policy.min_replicas < 1:
        errors.append("min_replicas must be an integer of at least 1 (an idle service goes to zero by sleeping)")
    if not isinstance(policy.max_replicas, int) or policy.max_replicas < 1:
        errors.append("max_replicas must be an integer of at least 1")
    elif isinstance(policy.min_replicas, int) and policy.max_replicas < policy.min_replicas:
        errors.append(f"max_replicas ({policy.max_replicas}) is below min_replicas ({policy.min_replicas})")
    targets = (policy.target_in_flight, policy.target_tokens_per_s, policy.target_gpu_utilisation)
    if all(target is None for target in targets):
        errors.append("set at least one target: target_in_flight, target_tokens_per_s or target_gpu_utilisation")
    for name in ("target_in_flight", "target_tokens_per_s", "max_in_flight_per_replica"):
        value = getattr(policy, name)
        if value is not None and not value > 0:
            errors.append(f"{name} must be above 0")
    if policy.target_gpu_utilisation is not None and not 0 < policy.target_gpu_utilisation <= 100:
        errors.append("target_gpu_utilisation must be a percentage above 0 and at most 100")
    for name in (
        "scale_up_cooldown_s",
        "scale_down_cooldown_s",
        "scale_up_stabilisation_s",
        "scale_down_stabilisation_s",
    ):
        if getattr(policy, name) < 0:
            errors.append(f"{name} must not be negative")
    if not policy.max_sample_age_s > 0:
        errors.append("max_sample_age_s must be above 0")
    return errors


def _fmt(value: float) -> str:
    """12.3, 8, 0.5: figures as a person writes them."""
    return f"{value:.1f}".removesuffix(".0")


def _cmp(value: float, target: float) -> str:
    return ">" if value > target else "<" if value < target else "="


def needs_of(sample: Sample, policy: ScalingPolicy, state: ScalingState) -> list[Need]:
    """Each targeted signal's need in one sample (signals not read give none)."""
    needs = []
    if policy.target_in_flight is not None and sample.in_flight is not None:
        load = sample.in_flight + (sample.queued or 0)
        per = load / max(state.replicas, 1)
        queued = f" + {sample.queued} queued" if sample.queued else ""
        needs.append(
            Need(
                math.ceil(load / policy.target_in_flight),
                sample.at,
                "in_flight",
                f"in flight {sample.in_flight}{queued} over {state.replicas} replicas = {_fmt(per)} "
                f"{_cmp(per, policy.target_in_flight)} target {_fmt(policy.target_in_flight)}",
            )
        )
    if policy.target_tokens_per_s is not None and sample.tokens_per_s is not None:
        per = sample.tokens_per_s / max(state.replicas, 1)
        needs.append(
            Need(
                math.ceil(sample.tokens_per_s / policy.target_tokens_per_s),
                sample.at,
                "tokens_per_s",
                f"tokens/s {_fmt(sample.tokens_per_s)} over {state.replicas} replicas = {_fmt(per)} "
                f"{_cmp(per, policy.target_tokens_per_s)} target {_fmt(policy.target_tokens_per_s)}",
            )
        )
    if policy.target_gpu_utilisation is not None and sample.gpu_utilisation is not None:
        # utilisation is a share of the healthy replicas' cards: the load they carry now,
        # spread over enough replicas to bring it to the target
        serving = state.healthy or state.replicas
        target = policy.target_gpu_utilisation
        needs.append(
            Need(
                math.ceil(serving * sample.gpu_utilisation / target),
                sample.at,
                "gpu_utilisation",
                f"GPU {_fmt(sample.gpu_utilisation)}% over {serving} healthy replicas "
                f"{_cmp(sample.gpu_utilisation, target)} target {_fmt(target)}%",
            )
        )
    return needs


def _targeted(policy: ScalingPolicy) -> list[str]:
    return [
        name
        for name, target in (
            ("in_flight", policy.target_in_flight),
            ("tokens_per_s", policy.target_tokens_per_s),
            ("gpu_utilisation", policy.target_gpu_utilisation),
        )
        if target is not None
    ]


def _missing(sample: Sample, policy: ScalingPolicy) -> list[str]:
    return [name for name in _targeted(policy) if getattr(sample, name) is None]


def _largest(needs: Sequence[Need]) -> Need:
    # ties: the latest sample; within one sample, the first signal (in flight, tokens, GPU)
    return max(needs, key=lambda need: (need.replicas, need.at))


def _since(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else (now - then).total_seconds()


def decide(policy: ScalingPolicy, state: ScalingState, samples: Sequence[Sample], now: datetime) -> ScaleDecision:
    """The decision for one service at `now` (see the module's rules)."""
    current = state.replicas

    def result(direction: Direction, desired: int, reason: str, **signals) -> ScaleDecision:
        return ScaleDecision(direction, current, desired, reason, signals)

    if state.sleeping:
        return result(Direction.SKIP, current, "sleeping: no scaling until it wakes")
    if state.window_holds:
        return result(Direction.SKIP, current, "a scheduling window holds the replica count")

    low, high = policy.min_replicas, policy.max_replicas
    if current < low:
        return result(Direction.UP, low, f"{current} replicas is below min {low}: up to {low}")
    if current > high:
        return result(Direction.DOWN, high, f"{current} replicas is above max {high}: down to {high}")

    series = sorted((s for s in samples if s.at <= now), key=lambda s: s.at)
    latest = series[-1] if series else None
    if latest is None or (now - latest.at).total_seconds() > policy.max_sample_age_s:
        when = "never" if latest is None else f"{_fmt((now - latest.at).total_seconds())} s ago"
        return result(Direction.HOLD, current, f"no signal (last sample {when}): hold at {current}")
    latest_needs = needs_of(latest, policy, state)
    if not latest_needs:
        missing = ", ".join(_missing(latest, policy))
        return result(Direction.HOLD, current, f"no reading of {missing} in the last sample: hold at {current}")

    # up: every sample of the up-stabilisation must ask for more (the smallest need decides)
    up_from = now - timedelta(seconds=policy.scale_up_stabilisation_s)
    up_needs = [_largest(needs) for s in series if s.at >= up_from and (needs := needs_of(s, policy, state))]
    up_need = min(up_needs, key=lambda need: need.replicas) if up_needs else _largest(latest_needs)
    if up_need.replicas > current:
        desired = min(up_need.replicas, high)
        figures = {"need": up_need.replicas, "signal": up_need.signal}
        if desired == current:
            reason = f"{up_need.figures}: needs {up_need.replicas}, at max {high}"
            return result(Direction.HOLD, current, reason, **figures)
        since = _since(now, state.last_change_at)
        if state.last_direction == Direction.UP and since is not None and since < policy.scale_up_cooldown_s:
            return result(
                Direction.HOLD,
                current,
                f"{up_need.figures}: would go up to {desired}, but the last scale-up was {_fmt(since)} s ago "
                f"(cooldown {_fmt(policy.scale_up_cooldown_s)} s)",
                **figures,
            )
        capped = f" (needs {up_need.replicas}, max {high})" if desired < up_need.replicas else ""
        return result(Direction.UP, desired, f"{up_need.figures}: up to {desired}{capped}", **figures)

    latest_need = _largest(latest_needs)
    if latest_need.replicas > current:
        return result(
            Direction.HOLD,
            current,
            f"{latest_need.figures}: not sustained over the {_fmt(policy.scale_up_stabilisation_s)} s "
            f"scale-up stabilisation (smallest need {up_need.replicas}), hold at {current}",
            need=up_need.replicas,
        )

    # down: the whole stabilisation must be read, every targeted signal, and ask for less
    down_from = now - timedelta(seconds=policy.scale_down_stabilisation_s)
    window = [s for s in series if s.at >= down_from] or [latest]
    down_need = _largest([need for s in window for need in needs_of(s, policy, state)])
    if down_need.replicas >= current:
        return result(Direction.HOLD, current, f"{down_need.figures}: steady at {current}", need=down_need.replicas)
    gaps = sorted({name for s in window for name in _missing(s, policy)})
    if gaps:
        return result(
            Direction.HOLD,
            current,
            f"missing {', '.join(gaps)} readings in the last {_fmt(policy.scale_down_stabilisation_s)} s: "
            f"no scale-down on missing data, hold at {current}",
        )
    reach = (now - window[0].at).total_seconds()
    # the oldest sample must sit at the window's start, give or take one sample's age
    if reach + policy.max_sample_age_s < policy.scale_down_stabilisation_s:
        return result(
            Direction.HOLD,
            current,
            f"samples reach back {_fmt(reach)} s of the {_fmt(policy.scale_down_stabilisation_s)} s "
            f"stabilisation: no scale-down on missing data, hold at {current}",
        )
    gap = max(((b.at - a.at).total_seconds() for a, b in zip(window, window[1:], strict=False)), default=0.0)
    if gap > policy.max_sample_age_s:
        return result(
            Direction.HOLD,
            current,
            f"no sample for {_fmt(gap)} s inside the last {_fmt(policy.scale_down_stabilisation_s)} s: "
            f"no scale-down on missing data, hold at {current}",
        )
    floor = 0
    capacity = policy.capacity_per_replica
    if capacity is not None and latest.in_flight is not None:
        floor = math.ceil(latest.in_flight / capacity)
    desired = max(down_need.replicas, low, floor)
    figures = {"need": down_need.replicas, "signal": down_need.signal, "floor": floor}
    if desired >= current:
        why = f"at min {low}" if low >= current else f"{latest.in_flight} in flight need {floor} replicas"
        return result(Direction.HOLD, current, f"{down_need.figures}: {why}, hold at {current}", **figures)
    since = _since(now, state.last_change_at)
    if since is not None and since < policy.scale_down_cooldown_s:
        return result(
            Direction.HOLD,
            current,
            f"{down_need.figures}: would go down to {desired}, but the last change was {_fmt(since)} s ago "
            f"(cooldown {_fmt(policy.scale_down_cooldown_s)} s)",
            **figures,
        )
    held = ""
    if desired > down_need.replicas:
        held = f" (min {low})" if desired == low and low > floor else f" ({latest.in_flight} in flight need {floor})"
    return result(
        Direction.DOWN,
        desired,
        f"highest over the last {_fmt(policy.scale_down_stabilisation_s)} s: {down_need.figures}: "
        f"down to {desired}{held}",
        **figures,
    )
