"""When pending work is expected to start: the queue simulated forward from now on a
copy of the snapshot, with a simulated clock, by the real placement (`place_queue`).
Pure, like the rest of the core: the shell (apps.scheduler.predictions) gives it the
snapshot, the queue in its order, when the running work is expected to end and how long
each waiting item is expected to run (docs/predictions.md).

One simulation (`simulate`):

- At each step (first now, then the next time some work is expected to end) the work
  expected to have ended leaves its cards, and the queue still waiting is placed by
  `place_queue`, in the real order: priority, fair share (a QueueBook rebuilt from what
  the simulated fleet holds), the gangs' reservations, backfill (dated by the simulated
  ends). What is placed starts then and ends after its expected duration.
- It stops when the queue is empty, when nothing more is expected to end, after
  `max_steps` steps or past `horizon` seconds. Steps closer together than
  STEP_FRACTION of the time simulated so far are merged: an estimate may be late by
  that fraction of its wait (5 %), and a long horizon costs a few hundred steps at most.
  What was not placed by then has no estimate (None), with a basis saying why.

`estimate` runs it twice, with every duration at its p50 and at its p90, and pairs the
two starts: p50 from the first, p90 from the second (never before the p50; None when the
second does not place it within its bounds).

What it does not model (said in docs/predictions.md): work submitted later, preemption
and loans, cards or nodes coming and going, load readings changing (the readings are
used in the first step only), the decay of fair-share usage, and the slices a MIG card
carves (a share placed in the simulation keeps its carving).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from apps.scheduler.core.groups import GroupReq
from apps.scheduler.core.placement import Placement, place_queue
from apps.scheduler.core.queues import QueueBook, QueueSpec, holdings_of
from apps.scheduler.core.snapshot import GpuSnap, NodeSnap, PluginSettings, TaskReq

DEFAULT_HORIZON_SECONDS = 3 * 24 * 3600  # three days: past that an estimate says little
DEFAULT_MAX_STEPS = 500
STEP_FRACTION = 0.05  # the steps' spacing, as a fraction of the time simulated so far

FITS_NOW = "fits now: placed by the next scheduler cycle"
TYPE_ABSENT = "waits for a node type that is not in the cluster"
NEVER_FITS = "would not fit even on the idle cluster"
BEYOND = "not placed within the simulated horizon"
STALLED = "not placed once every running and simulated task had ended"


@dataclass(frozen=True)
class Duration:
    """How long a piece of work is expected to run (seconds): its median and 90th
    percentile, and where they come from (declared, learned from N runs, its timeout)."""

    p50: float
    p90: float
    basis: str


@dataclass(frozen=True)
class Estimate:
    """When an item is expected to start (epoch seconds), or None with the reason."""

    p50: float | None
    p90: float | None
    basis: str


@dataclass
class Simulation:
    """One simulation's outcome: start time by item key, the reason for each item that
    got none, and how many steps it took."""

    starts: dict[tuple[str, int], float] = field(default_factory=dict)
    unplaced: dict[tuple[str, int], str] = field(default_factory=dict)
    steps: int = 0


def item_key(item: TaskReq | GroupReq) -> tuple[str, int]:
    """A queue item's key: task and group ids are separate sequences."""
    return ("group" if isinstance(item, GroupReq) else "task", item.id)


def copy_nodes(nodes: Iterable[NodeSnap]) -> list[NodeSnap]:
    """A copy of the snapshot that a simulation may change: each card's holders its own."""
    return [replace(node, gpus=[replace(gpu, holders=list(gpu.holders)) for gpu in node.gpus]) for node in nodes]


def simulate(
    queue: Sequence[TaskReq | GroupReq],
    nodes: Sequence[NodeSnap],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    now: float,
    running_ends: Mapping[int, float],
    durations: Mapping[tuple[str, int], float],
    specs: Sequence[QueueSpec] = (),
    history: Mapping[int, float] | None = None,
    reserving: Mapping[int, Sequence[str]] | None = None,
    horizon: float = DEFAULT_HORIZON_SECONDS,
    max_steps: int = DEFAULT_MAX_STEPS,
    step_fraction: float = STEP_FRACTION,
) -> Simulation:
    """The queue (in queue order) simulated forward from `now`. `running_ends`: the
    holders' task id -> when it is expected to end (a holder not named there never ends
    in the simulation); `durations`: item key -> its expected run time, seconds (an item
    not named there runs for the whole horizon); `specs` and `history`: the tenants'
    queues and decayed usage (the fair-share book is rebuilt at each step from what the
    simulated fleet holds); `reserving`: the gangs that reserve (group id -> the nodes
    they targeted), as the cycle gives them to `place_queue`."""
    fleet = copy_nodes(nodes)
    ends: dict[int, float] = dict(running_ends)
    waiting = list(queue)
    result = Simulation()
    clock = now
    while waiting and result.steps < max_steps and clock - now <= horizon:
        if result.steps:
            _free_ended(fleet, ends, clock)
        book = QueueBook(specs, holdings_of(fleet), history) if specs else None
        reserved = {item.id: list(reserving[item.id]) for item in waiting if reserving and item.id in reserving}
        if specs or reserved:
            trying = waiting if specs else could_fit(waiting, fleet, reserved)
            placement = place_queue(
                trying, fleet, settings, may_share, reserving=reserved, book=book, now=clock, ends=ends
            )
        else:
            placement = _place_in_passes(waiting, fleet, settings, may_share, clock, ends)
        result.steps += 1
        placed: set[tuple[str, int]] = set()
        for decision in placement.decisions:
            key = ("task", decision.task_id)
            placed.add(key)
            ends[decision.task_id] = clock + durations.get(key, horizon)
        for group in placement.groups:
            key = ("group", group.group_id)
            placed.add(key)
            for member in group.decisions:
                ends[member.task_id] = clock + durations.get(key, horizon)
        for key in placed:
            result.starts[key] = clock
        _drop_reservation_holds(fleet)
        waiting = [item for item in waiting if item_key(item) not in placed]
        later = [end for end in ends.values() if end > clock]
        if not later:
            for item in waiting:
                result.unplaced[item_key(item)] = STALLED
            waiting = []
            break
        # the next end, but no sooner than STEP_FRACTION of the wait so far: a start is
        # late by at most that fraction of its wait, and a horizon takes about
        # log(horizon / first end) / log(1 + STEP_FRACTION) steps, not one per end
        clock = max(min(later), clock + step_fraction * (clock - now))
    for item in waiting:
        result.unplaced[item_key(item)] = BEYOND
    return result


def _place_in_passes(
    waiting: Sequence[TaskReq | GroupReq],
    fleet: list[NodeSnap],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    clock: float,
    ends: Mapping[int, float],
) -> Placement:
    """One step's placement without queues or reservations, where an item that fails
    changes nothing for those after it: the cost of a step is the items it tries, so it
    tries them in passes, in queue order. Each pass takes the items the free cards could
    take by their count (could_fit), up to where their cards add up to more than are
    free (an item past that fits only if one before it fails: it is in the next pass,
    which begins with what is free then). The same decisions as one call on the whole
    queue (on a fleet large enough to be sampled, nodes_to_score, the sampling may start
    elsewhere)."""
    placement = Placement()
    remaining = list(waiting)
    while remaining:
        candidates = could_fit(remaining, fleet, {})
        if not candidates:
            break
        budget = sum(1 for node in fleet for gpu in node.gpus if gpu.placeable and not gpu.holders)
        batch = []
        for item in candidates:
            need = item.gpus_per_worker * item.world_size if isinstance(item, GroupReq) else item.gpu_required
            if need > budget and batch:
                break
            batch.append(item)
            budget -= need
        found = place_queue(batch, fleet, settings, may_share, now=clock, ends=ends)
        placement.decisions += found.decisions
        placement.groups += found.groups
        tried = {item_key(item) for item in batch}
        after = candidates[len(batch)] if len(batch) < len(candidates) else None
        if after is None:
            break
        # the items before the first untried candidate that were not candidates would fail
        # now as they did: the next pass starts at that candidate
        position = next(k for k, item in enumerate(remaining) if item is after)
        remaining = [item for item in remaining[position:] if item_key(item) not in tried]
    return placement


def could_fit(
    waiting: Sequence[TaskReq | GroupReq], fleet: Sequence[NodeSnap], reserving: Mapping[int, Sequence[str]]
) -> list[TaskReq | GroupReq]:
    """The waiting items the free cards could take by their count alone (a necessary
    condition, never a placement rule): a task's whole cards free on one node of its type,
    a gang's cards per worker on one node and all its cards in the fleet. Shares, work
    without cards and the gangs that reserve are always kept."""
    return fits_by_count(waiting, *idle_counts(fleet), reserving)


def idle_counts(fleet: Iterable[NodeSnap]) -> tuple[dict[str, int], dict[str, int]]:
    """Per vendor ("" for any): the most idle whole cards on one node, and in all."""
    most: dict[str, int] = {}
    total: dict[str, int] = {}
    for node in fleet:
        here: dict[str, int] = {}
        for gpu in node.gpus:
            if gpu.placeable and not gpu.holders:
                vendor = gpu.vendor.lower()
                here[vendor] = here.get(vendor, 0) + 1
        here[""] = sum(here.values())
        for vendor, count in here.items():
            most[vendor] = max(most.get(vendor, 0), count)
            total[vendor] = total.get(vendor, 0) + count
    return most, total


def fits_by_count(
    waiting: Sequence[TaskReq | GroupReq],
    most: Mapping[str, int],
    total: Mapping[str, int],
    reserving: Mapping[int, Sequence[str]],
) -> list[TaskReq | GroupReq]:
    """could_fit, given the idle counts (idle_counts)."""
    kept = []
    for item in waiting:
        if isinstance(item, GroupReq):
            vendor = item.gpu_type.lower()
            fits = item.id in reserving or (
                most.get(vendor, 0) >= item.gpus_per_worker
                and total.get(vendor, 0) >= item.gpus_per_worker * item.world_size
            )
        else:
            fits = item.gpu_required == 0 or most.get(item.gpu_type.lower(), 0) >= item.gpu_required
        if fits:
            kept.append(item)
    return kept


def _free_ended(fleet: list[NodeSnap], ends: dict[int, float], clock: float) -> None:
    """The work expected to have ended by `clock` leaves its cards; the cards' readings
    are dropped (they were true of now only) and so is the last step's placed memory."""
    ended = {task_id for task_id, end in ends.items() if end <= clock}
    for task_id in ended:
        del ends[task_id]
    for node in fleet:
        for gpu in node.gpus:
            gpu.memory_used_mb = gpu.utilization = gpu.temperature = None
            gpu.placed_mb = 0
            if ended and gpu.holders:
                gpu.holders = [holder for holder in gpu.holders if holder[0] not in ended]


def _drop_reservation_holds(fleet: list[NodeSnap]) -> None:
    """A reservation's holds last one cycle (the next one holds again): its pseudo-holders
    (negative ids, core.groups.reservation_holder) leave the simulated cards."""
    for node in fleet:
        for gpu in node.gpus:
            if gpu.holders and any(holder[0] < 0 for holder in gpu.holders):
                gpu.holders = [holder for holder in gpu.holders if holder[0] >= 0]


class IdleCluster:
    """The cluster with every card free (readings dropped), built once, to ask of each
    item that got no start whether it could ever start here (`why_never`). A node an
    item is placed on is built again from the snapshot before the next question."""

    def __init__(self, nodes: Sequence[NodeSnap], settings: PluginSettings, may_share: Callable[[int, int], bool]):
        self.nodes = list(nodes)
        self.idle = idle_fleet(self.nodes)
        self.vendors = {gpu.vendor.lower() for node in self.nodes for gpu in node.gpus}
        self.settings, self.may_share = settings, may_share

    def why_never(self, item: TaskReq | GroupReq) -> str | None:
        """Why the item could never start on this cluster, or None if it would fit with
        every card free: its type is on no node, or the real placement rejects it even
        then."""
        gpu_type = item.gpu_type.lower()
        if gpu_type and gpu_type not in self.vendors:
            return TYPE_ABSENT
        placement = place_queue([item], self.idle, self.settings, self.may_share)
        decisions = placement.decisions + [d for group in placement.groups for d in group.decisions]
        if not decisions:
            return NEVER_FITS
        touched = {decision.node_id for decision in decisions}
        for position, node in enumerate(self.nodes):
            if node.id in touched:
                self.idle[position] = _idle_node(node)
        return None


def why_never(
    item: TaskReq | GroupReq,
    nodes: Sequence[NodeSnap],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
) -> str | None:
    """IdleCluster.why_never for one item."""
    return IdleCluster(nodes, settings, may_share).why_never(item)


def _idle_node(node: NodeSnap) -> NodeSnap:
    return replace(node, gpus=[_idle(gpu) for gpu in node.gpus])


def idle_fleet(nodes: Iterable[NodeSnap]) -> list[NodeSnap]:
    """The fleet with every card free and its readings dropped (a replay starts from it)."""
    return [_idle_node(node) for node in nodes]


def _idle(gpu: GpuSnap) -> GpuSnap:
    return replace(gpu, holders=[], memory_used_mb=None, utilization=None, temperature=None, placed_mb=0)


def estimate(
    queue: Sequence[TaskReq | GroupReq],
    nodes: Sequence[NodeSnap],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    now: float,
    running: Mapping[int, Duration],
    durations: Mapping[tuple[str, int], Duration],
    specs: Sequence[QueueSpec] = (),
    history: Mapping[int, float] | None = None,
    reserving: Mapping[int, Sequence[str]] | None = None,
    horizon: float = DEFAULT_HORIZON_SECONDS,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> dict[tuple[str, int], Estimate]:
    """Every queue item's estimate (item key -> Estimate). `running`: the holders' task id
    -> when they are expected to end, as a Duration of absolute times (p50, p90);
    `durations`: item key -> its expected run time. Two simulations, one at p50 and one
    at p90; an item not placed in the p50 one has no estimate, with the reason (its type
    absent, it never fits, or the bounds)."""
    common = dict(specs=specs, history=history, reserving=reserving, horizon=horizon, max_steps=max_steps)
    median = simulate(
        queue,
        nodes,
        settings,
        may_share,
        now,
        {task: end.p50 for task, end in running.items()},
        {key: duration.p50 for key, duration in durations.items()},
        **common,
    )
    late = simulate(
        queue,
        nodes,
        settings,
        may_share,
        now,
        {task: end.p90 for task, end in running.items()},
        {key: duration.p90 for key, duration in durations.items()},
        **common,
    )
    estimates = {}
    idle = None
    for item in queue:
        key = item_key(item)
        start = median.starts.get(key)
        if start is None:
            idle = idle or IdleCluster(nodes, settings, may_share)
            never = idle.why_never(item)
            estimates[key] = Estimate(None, None, never or median.unplaced.get(key, BEYOND))
            continue
        start_late = late.starts.get(key)
        # p90 None: at p90 it does not start within the simulated bounds
        p90 = None if start_late is None else max(start, start_late)
        if start == now:
            estimates[key] = Estimate(start, p90, FITS_NOW)
        else:
            estimates[key] = Estimate(start, p90, "simulated queue: starts when the work ahead of it ends")
    return estimates
