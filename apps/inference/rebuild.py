"""The rebuild decision (the 10 s job): which of a service's replicas to recreate, when,
and when to raise a crash-loop alert. Pure: the service's state, its replica count, its
replica slots (one per rank, with the restart history) and the time in; one action per
slot out. The job recreates through the scheduler (a new attempt of the slot goes back to
the queue; `elsewhere` asks placement to avoid the node it was on).

Rules (docs/inference.md, Rebuild):
- only a starting or running service is rebuilt (a sleeping, waking, paused or stopping one
  has its own path: the wake queue, the window, the stop);
- a slot whose replica died is recreated; a slot whose node is judged dead is recreated
  elsewhere at once (a lost node is not the replica's fault and does not count as a crash);
  a slot whose node could not be read this round is left alone;
- crash-loop back-off: a slot recreated k times in the last `crash_window_s` waits
  `min(cap, base × 2^(k-1))` after its death before the next attempt (k = 0: at once);
  when k reaches `alert_after`, the decision carries the alert flag (once: not while the
  slot's alert is open);
- ranks missing below the service's count are created; a dead slot at or above the count
  (left over from a scale-down) is not recreated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from apps.inference.sleep import NodeHealth, ServiceState


class ReplicaHealth(StrEnum):
    HEALTHY = "healthy"  # answers its health probe
    STARTING = "starting"  # placed or starting, not yet healthy
    PENDING = "pending"  # waiting for placement (the scheduler has it)
    DIED = "died"  # its process or container ended (failed, exited, lost)


class RebuildKind(StrEnum):
    KEEP = "keep"  # nothing to do
    RECREATE = "recreate"  # died: a new attempt through the scheduler
    RECREATE_ELSEWHERE = "recreate_elsewhere"  # its node is dead: a new attempt on another node
    CREATE = "create"  # a missing rank below the count
    BACK_OFF = "back_off"  # died, crash-looping: not before `not_before`
    LEAVE = "leave"  # its node cannot be read this round, or the rank is above the count


@dataclass(frozen=True)
class RebuildPolicy:
    backoff_base_s: float = 10.0
    backoff_cap_s: float = 300.0
    crash_window_s: float = 600.0
    alert_after: int = 5  # restarts within the crash window


@dataclass(frozen=True)
class ReplicaSlot:
    rank: int
    health: ReplicaHealth
    node: NodeHealth = NodeHealth.ALIVE  # the node it is on (PENDING: not read)
    node_id: str | None = None
    died_at: datetime | None = None  # for DIED
    restarts: tuple[datetime, ...] = ()  # when this slot was recreated after a crash
    alert_open: bool = False  # a crash-loop alert for this slot is open already


@dataclass(frozen=True)
class RebuildAction:
    rank: int
    kind: RebuildKind
    reason: str
    not_before: datetime | None = None  # BACK_OFF: the earliest next attempt
    avoid_node: str | None = None  # RECREATE_ELSEWHERE: the node to keep away from
    alert: bool = False  # raise the crash-loop alert now
    counts_as_restart: bool = False  # the job appends `now` to the slot's restarts


REBUILT_STATES = frozenset({ServiceState.STARTING, ServiceState.RUNNING})


def backoff_s(policy: RebuildPolicy, recent_restarts: int) -> float:
    if recent_restarts <= 0:
        return 0.0
    return min(policy.backoff_cap_s, policy.backoff_base_s * 2 ** (recent_restarts - 1))


def plan(
    state: ServiceState,
    replicas: int,
    slots: Sequence[ReplicaSlot],
    policy: RebuildPolicy,
    now: datetime,
) -> list[RebuildAction]:
    """One action per slot and per missing rank, in rank order; empty for a service in a
    state that is not rebuilt."""
    if ServiceState(state) not in REBUILT_STATES:
        return []
    ranks = {slot.rank for slot in slots}
    if len(ranks) != len(slots):
        raise ValueError("two slots share a rank")
    actions = [_one(slot, replicas, policy, now) for slot in slots]
    actions += [
        RebuildAction(rank, RebuildKind.CREATE, f"rank {rank} is missing below the count of {replicas}")
        for rank in range(replicas)
        if rank not in ranks
    ]
    return sorted(actions, key=lambda action: action.rank)


def _one(slot: ReplicaSlot, replicas: int, policy: RebuildPolicy, now: datetime) -> RebuildAction:
    rank = slot.rank
    if slot.health == ReplicaHealth.PENDING:
        return RebuildAction(rank, RebuildKind.KEEP, "waiting for placement")
    if slot.health != ReplicaHealth.DIED and slot.node == NodeHealth.UNKNOWN:
        return RebuildAction(rank, RebuildKind.LEAVE, f"node {slot.node_id} could not be read this round: left alone")
    if slot.node == NodeHealth.DEAD:
        if rank >= replicas:
            return RebuildAction(rank, RebuildKind.LEAVE, f"rank {rank} is above the count of {replicas}")
        return RebuildAction(
            rank,
            RebuildKind.RECREATE_ELSEWHERE,
            f"node {slot.node_id} is dead: recreated elsewhere",
            avoid_node=slot.node_id,
        )
    if slot.health in (ReplicaHealth.HEALTHY, ReplicaHealth.STARTING):
        return RebuildAction(rank, RebuildKind.KEEP, str(slot.health))
    # died
    if rank >= replicas:
        return RebuildAction(rank, RebuildKind.LEAVE, f"rank {rank} is above the count of {replicas}: not recreated")
    window_start = now - timedelta(seconds=policy.crash_window_s)
    recent = sum(1 for at in slot.restarts if at > window_start)
    alert = recent >= policy.alert_after and not slot.alert_open
    delay = backoff_s(policy, recent)
    died_at = slot.died_at or now
    not_before = died_at + timedelta(seconds=delay)
    history = f"{recent} restarts in the last {policy.crash_window_s:.0f} s"
    if now < not_before:
        return RebuildAction(
            rank,
            RebuildKind.BACK_OFF,
            f"died, {history}: backing off {delay:.0f} s",
            not_before=not_before,
            alert=alert,
        )
    waited = f", after {delay:.0f} s back-off" if delay else ""
    return RebuildAction(
        rank, RebuildKind.RECREATE, f"died, {history}: recreated{waited}", alert=alert, counts_as_restart=True
    )
