"""Replaying a stream of work on a fleet under a policy (docs/simulate.md): the real
placement (`place_queue`) run on a simulated clock, as the scheduler's cycle would run
it, with work arriving as the trace says and leaving when its run time is up. Pure, like
the rest of the core: the shell (apps.scheduler.simulate) builds the fleet, the jobs and
the policy; this module writes no placement rule of its own.

A run steps through cycles: the first at the first arrival, then every
`policy.cycle_seconds` while anything waits, jumping over the cycles in which nothing
arrives and nothing ends. At each cycle:

1. the work whose run time is up leaves its cards;
2. what arrived since the last cycle joins the queue, which is kept in the real order
   (priority, then submission);
3. the heads of their priorities among the gangs reserve, once they have waited at the
   head for `policy.reserve_after_seconds` (their targets carried from cycle to cycle, as
   the cycle stores them);
4. `place_queue` places the queue, with the tenants' queues (fair share, a QueueBook
   rebuilt from what the fleet holds and the usage so far, decayed) and backfill (the
   simulated ends);
5. what was placed starts, and ends after its duration.

What it measures: each job's wait and completion time, the share of cards in use over
time, fragmentation (idle cards on nodes partly in use; gangs left waiting although the
fleet had enough idle cards of their type in all), and the reservations made. It does
not model preemption or reclaim (reported as 0 and said so), nodes failing, or load
readings."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from apps.scheduler.core.forecast import copy_nodes, fits_by_count, idle_counts
from apps.scheduler.core.groups import GroupReq
from apps.scheduler.core.placement import Placement, place_queue
from apps.scheduler.core.queues import QueueBook, QueueSpec, holdings_of
from apps.scheduler.core.snapshot import NodeSnap, PluginSettings, TaskReq
from apps.tasks.choices import TaskKind

DAY = 86400.0
SAMPLES = 400  # utilisation and fragmentation samples kept per run, spread over it


@dataclass(frozen=True)
class Job:
    """One piece of work in a trace: submitted at `submit` (seconds from the trace's
    start), `workers` × `gpus` cards of `gpu_type` (a gang when workers > 1), running for
    `duration` seconds once placed."""

    id: int
    submit: float
    tenant_id: int
    gpus: int
    duration: float
    gpu_type: str = "nvidia"
    priority: int = 50
    workers: int = 1
    declared: float | None = None  # max_duration_seconds: may backfill behind a reservation


@dataclass(frozen=True)
class Policy:
    """What a replay varies: the placement's settings (layout, plugins, weights), the
    tenants' queues (nominal quotas, weights, cohorts; fair share by decayed usage), when a
    waiting gang starts to reserve, and how often the scheduler runs."""

    name: str = "default"
    settings: PluginSettings = field(default_factory=PluginSettings)
    specs: tuple[QueueSpec, ...] = ()
    half_life_seconds: float = 7 * DAY
    reserve_after_seconds: float | None = 300.0  # None: gangs never reserve
    backfill: bool = True
    cycle_seconds: float = 30.0
    # what a running job is expected to run when it declares nothing: the scheduler dates
    # reservations by declared durations, else timeouts, never by the true ends
    timeout_seconds: float = 3 * 86400.0


@dataclass
class Outcome:
    """One job's fate: when it started and ended (None: still waiting when the run
    stopped)."""

    job: Job
    start: float | None = None
    end: float | None = None


@dataclass
class Report:
    policy: str
    outcomes: dict[int, Outcome]
    cycles: int = 0
    # (time, share of cards in use, idle cards on nodes partly in use, gangs waiting with room)
    samples: list[tuple[float, float, int, int]] = field(default_factory=list)
    reservations: int = 0  # cycles × gangs holding cards for themselves
    blocked_gang_cycles: int = 0  # cycles × gangs left waiting though enough cards were idle in all
    preemptions: int = 0  # not modelled
    reclaims: int = 0  # not modelled


def replay(
    jobs: Iterable[Job],
    nodes: Sequence[NodeSnap],
    policy: Policy,
    may_share: Callable[[int, int], bool] = lambda a, b: a == b,
    until: float | None = None,
    progress: Callable[[float], None] | None = None,
    on_cycle: Callable[[float, ReplayFleet, list, set[int], Report], None] | None = None,
) -> Report:
    """Run `jobs` through the fleet `nodes` (copied: the caller's snapshot is untouched)
    under `policy`, until every job has ended or the clock passes `until` (seconds).

    Only the nodes with an idle card are given to the placement (a node with none can
    take no whole card), unless a gang reserves that cycle: its targets and the expected
    ends of the work on them need the whole fleet.

    `on_cycle(clock, fleet, waiting, arrived, report)`, after each cycle's placement: the
    queue still waiting (requests in queue order), the ids of the jobs that arrived for
    this cycle, and the report so far (the start-time estimates' bench uses it to run the
    forecast as the predictor would, make bench-predict)."""
    arrivals = sorted(jobs, key=lambda job: (job.submit, job.id))
    report = Report(policy.name, {job.id: Outcome(job) for job in arrivals})
    if not arrivals:
        return report
    run = ReplayFleet(copy_nodes(nodes), policy, may_share)
    members = _member_ids(arrivals)
    owner = run.owner = {member: job.id for job in arrivals for member in members[job.id]}
    requests = {job.id: _request(job, members[job.id]) for job in arrivals}
    waiting: list[tuple[tuple, TaskReq | GroupReq]] = []  # (queue order key, request), sorted
    head_since: dict[int, float] = {}  # gang id -> when it became the head of its priority
    targets: dict[int, tuple[str, ...]] = {}  # gang id -> the nodes its reservation targeted
    arrival = 0
    start = clock = last_clock = arrivals[0].submit
    span = arrivals[-1].submit - start
    horizon = until if until is not None else math.inf
    sample_every = max(span / SAMPLES, policy.cycle_seconds)
    next_sample = clock
    while clock <= horizon:
        run.end_until(clock)
        arrived: set[int] = set()
        while arrival < len(arrivals) and arrivals[arrival].submit <= clock:
            job = arrivals[arrival]
            arrived.add(job.id)
            bisect.insort(waiting, ((-job.priority, job.submit, job.id), requests[job.id]), key=lambda pair: pair[0])
            arrival += 1
        if policy.specs:
            _decay_and_charge(run.history, run.fleet, policy, clock - last_clock)
        queue = [request for _, request in waiting]
        reserving = run.reserving = _reserving(queue, head_since, targets, clock, policy) if waiting else {}
        if queue:
            placement = run.place(queue, reserving, clock)
            report.cycles += 1
            placed: set[int] = set()
            for decision in placement.decisions:
                placed.add(owner[decision.task_id])
            for group in placement.groups:
                placed.add(group.group_id)
            for job_id in placed:
                outcome = report.outcomes[job_id]
                outcome.start, outcome.end = clock, clock + outcome.job.duration
                expected = clock + (outcome.job.declared or policy.timeout_seconds)
                for member in members[job_id]:
                    run.will_end(member, outcome.end, expected)
                head_since.pop(job_id, None)
                targets.pop(job_id, None)
            for failure in placement.group_failures:
                if failure.reservation is not None:
                    report.reservations += 1
                    targets[failure.group_id] = tuple(failure.reservation.wanted)
            if placed:
                waiting = [pair for pair in waiting if pair[1].id not in placed]
            if any(isinstance(request, GroupReq) for _, request in waiting):
                report.blocked_gang_cycles += _gangs_with_room(waiting, run.idle_by_type())
        if on_cycle is not None:
            on_cycle(clock, run, [request for _, request in waiting], arrived, report)
        if clock >= next_sample:
            report.samples.append(run.sample(clock - start, waiting))
            next_sample = clock + sample_every
            if progress is not None and span > 0:
                progress(min((clock - start) / span, 1.0))
        # the next cycle: the next one at which something arrives or ends, while work waits
        last_clock = clock
        upcoming = [arrivals[arrival].submit] if arrival < len(arrivals) else []
        if run.end_heap:
            upcoming.append(run.end_heap[0][0])
        if not upcoming:
            break
        following = min(upcoming)
        if waiting and reserving:
            following = min(following, clock + policy.cycle_seconds)  # a reservation's holds are taken each cycle
        # cycles fall on the scheduler's beat from the first arrival
        clock = start + math.ceil((max(following, clock + 1e-9) - start) / policy.cycle_seconds) * policy.cycle_seconds
    return report


class ReplayFleet:
    """A replay's fleet and what it keeps to step it cheaply: where each task holds cards,
    the idle cards per node (kept for the nodes that change), the ends to come."""

    def __init__(self, fleet: list[NodeSnap], policy: Policy, may_share: Callable[[int, int], bool]):
        self.fleet, self.policy, self.may_share = fleet, policy, may_share
        self.position = {node.id: index for index, node in enumerate(fleet)}
        self.idle = [self._count_idle(node) for node in fleet]
        # each node's one vendor (None: mixed), for the idle counts by type
        vendors = [{gpu.vendor.lower() for gpu in node.gpus} for node in fleet]
        self.vendor = [next(iter(found)) if len(found) == 1 else None for found in vendors]
        self.cards = sum(1 for node in fleet for gpu in node.gpus if gpu.placeable) or 1
        self.where: dict[int, int] = {}  # task id -> node position
        self.ends: dict[int, float] = {}  # task id -> when it ends
        self.expected: dict[int, float] = {}  # task id -> when the scheduler expects it to end (backfill)
        self.end_heap: list[tuple[float, int]] = []
        self.history: dict[int, float] = {}  # tenant -> decayed card-seconds above nominal
        self.owner: dict[int, int] = {}  # task id -> its job's id (a gang's members: the gang's)
        self.reserving: dict[int, tuple[str, ...]] = {}  # this cycle's reserving gangs and their targets

    @staticmethod
    def _count_idle(node: NodeSnap) -> int:
        return sum(1 for gpu in node.gpus if gpu.placeable and not gpu.holders)

    def will_end(self, task_id: int, end: float, expected: float) -> None:
        self.ends[task_id] = end
        self.expected[task_id] = expected
        heapq.heappush(self.end_heap, (end, task_id))

    def end_until(self, clock: float) -> None:
        """The work whose run time is up by `clock` leaves its cards."""
        ended: dict[int, set[int]] = {}
        while self.end_heap and self.end_heap[0][0] <= clock:
            end, task_id = heapq.heappop(self.end_heap)
            if self.ends.get(task_id) == end:
                del self.ends[task_id]
                self.expected.pop(task_id, None)
                ended.setdefault(self.where.pop(task_id), set()).add(task_id)
        for position, tasks in ended.items():
            node = self.fleet[position]
            for gpu in node.gpus:
                if gpu.holders:
                    gpu.holders = [holder for holder in gpu.holders if holder[0] not in tasks]
            self.idle[position] = self._count_idle(node)

    def place(self, queue: list[TaskReq | GroupReq], reserving: dict[int, tuple[str, ...]], clock: float):
        policy = self.policy
        if reserving:
            nodes = self.fleet
        else:
            nodes = [node for node, idle in zip(self.fleet, self.idle, strict=True) if idle]
        book = QueueBook(policy.specs, holdings_of(self.fleet), self.history) if policy.specs else None
        trying = queue if book is not None else fits_by_count(queue, *self.idle_counts(), reserving)
        backfill = {"now": clock, "ends": self.expected} if policy.backfill else {}
        placement = Placement()
        if trying and nodes:
            placement = place_queue(
                trying, nodes, policy.settings, self.may_share, reserving=reserving, book=book, **backfill
            )
        touched = set()
        for decision in [*placement.decisions, *(d for group in placement.groups for d in group.decisions)]:
            position = self.position[decision.node_id]
            self.where[decision.task_id] = position
            touched.add(position)
        if reserving:
            _drop_holds(self.fleet)
            touched = range(len(self.fleet))
        for position in touched:
            self.idle[position] = self._count_idle(self.fleet[position])
        return placement

    def idle_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """forecast.idle_counts from the kept counts (a node of mixed vendors counted
        card by card)."""
        most: dict[str, int] = {}
        total: dict[str, int] = {}
        mixed = []
        for node, vendor, idle in zip(self.fleet, self.vendor, self.idle, strict=True):
            if not idle:
                continue
            if vendor is None:
                mixed.append(node)
                continue
            for key in (vendor, ""):
                if idle > most.get(key, 0):
                    most[key] = idle
                total[key] = total.get(key, 0) + idle
        if mixed:
            more_most, more_total = idle_counts(mixed)
            for key, count in more_most.items():
                most[key] = max(most.get(key, 0), count)
            for key, count in more_total.items():
                total[key] = total.get(key, 0) + count
        return most, total

    def idle_by_type(self) -> dict[str, int]:
        return self.idle_counts()[1]

    def sample(self, at: float, waiting) -> tuple[float, float, int, int]:
        """(time, share of cards in use, idle cards on nodes partly in use, gangs waiting
        with enough idle cards in all)."""
        stranded = 0
        used = 0
        for node, idle in zip(self.fleet, self.idle, strict=True):
            placeable = sum(1 for gpu in node.gpus if gpu.placeable)
            used += placeable - idle
            if idle and idle < placeable:
                stranded += idle
        return (at, used / self.cards, stranded, _gangs_with_room(waiting, self.idle_by_type()))


def _member_ids(jobs: Sequence[Job]) -> dict[int, tuple[int, ...]]:
    """A task id per worker: the job's own id for a single task, fresh ids past every job
    id for a gang's members."""
    next_id = max(job.id for job in jobs) + 1
    members = {}
    for job in jobs:
        if job.workers > 1:
            members[job.id] = tuple(range(next_id, next_id + job.workers))
            next_id += job.workers
        else:
            members[job.id] = (job.id,)
    return members


def _request(job: Job, members: tuple[int, ...]) -> TaskReq | GroupReq:
    declared = int(job.declared) if job.declared else None
    if job.workers > 1:
        return GroupReq(
            id=job.id,
            tenant_id=job.tenant_id,
            members=members,
            gpus_per_worker=job.gpus,
            gpu_type=job.gpu_type,
            priority=job.priority,
            max_duration=declared,
        )
    return TaskReq(
        id=job.id,
        tenant_id=job.tenant_id,
        gpu_required=job.gpus,
        gpu_type=job.gpu_type,
        priority=job.priority,
        kind=TaskKind.TRAINING,
        max_duration=declared,
    )


def _reserving(
    queue: Sequence[TaskReq | GroupReq],
    head_since: dict[int, float],
    targets: Mapping[int, tuple[str, ...]],
    clock: float,
    policy: Policy,
) -> dict[int, tuple[str, ...]]:
    """The gangs that reserve this cycle, as the cycle picks them
    (apps.scheduler.reservations): the first gang of each priority in queue order is its
    head; a head that has been one for reserve_after_seconds reserves, targeting the nodes
    it targeted last cycle."""
    if policy.reserve_after_seconds is None:
        return {}
    heads: dict[int, int] = {}
    for item in queue:
        if isinstance(item, GroupReq) and item.priority not in heads:
            heads[item.priority] = item.id
    current = set(heads.values())
    for gang in list(head_since):
        if gang not in current:
            del head_since[gang]
    reserving = {}
    for gang in current:
        since = head_since.setdefault(gang, clock)
        if clock - since >= policy.reserve_after_seconds:
            reserving[gang] = targets.get(gang, ())
    return reserving


def _decay_and_charge(history: dict[int, float], fleet: Sequence[NodeSnap], policy: Policy, elapsed: float) -> None:
    """Fair share's usage above nominal, decayed by the half-life over `elapsed` seconds
    and charged with what each tenant held above its nominal for them."""
    if elapsed <= 0:
        return
    factor = 0.5 ** (elapsed / policy.half_life_seconds)
    for tenant in list(history):
        history[tenant] *= factor
    specs = {spec.tenant_id: spec for spec in policy.specs}
    for (tenant, gpu_type), held in holdings_of(fleet).items():
        spec = specs.get(tenant)
        nominal = spec.quota(gpu_type).nominal if spec is not None else 0
        above = held - nominal
        if above > 0:
            history[tenant] = history.get(tenant, 0.0) + above * elapsed


def _drop_holds(fleet: Sequence[NodeSnap]) -> None:
    """A reservation's holds last one cycle (the next one holds again)."""
    for node in fleet:
        for gpu in node.gpus:
            if gpu.holders and any(holder[0] < 0 for holder in gpu.holders):
                gpu.holders = [holder for holder in gpu.holders if holder[0] >= 0]


def _gangs_with_room(waiting: Sequence[tuple[tuple, TaskReq | GroupReq]], idle: Mapping[str, int]) -> int:
    """The gangs left waiting although the fleet had, in all, enough idle cards of their
    type (`idle`, per type): their cards were there, in pieces."""
    return sum(
        1
        for _, request in waiting
        if isinstance(request, GroupReq)
        and idle.get(request.gpu_type.lower(), 0) >= request.gpus_per_worker * request.world_size
    )


def summary(report: Report) -> dict:
    """The figures of a run, as the JSON report gives them: per tenant the waits' p50,
    p90 and p99 and the jobs run; the completion times' p50 and p90; the mean share of
    cards in use; fragmentation; reservations; what is not modelled."""
    waits: dict[int, list[float]] = {}
    completions: list[float] = []
    unplaced = 0
    for outcome in report.outcomes.values():
        if outcome.start is None:
            unplaced += 1
            continue
        waits.setdefault(outcome.job.tenant_id, []).append(outcome.start - outcome.job.submit)
        completions.append(outcome.end - outcome.job.submit)
    every = sorted(wait for tenant_waits in waits.values() for wait in tenant_waits)
    return {
        "policy": report.policy,
        "jobs": len(report.outcomes),
        "placed": len(report.outcomes) - unplaced,
        "never_placed": unplaced,
        "cycles": report.cycles,
        "wait_seconds": {"p50": quantile(every, 0.5), "p90": quantile(every, 0.9), "p99": quantile(every, 0.99)},
        "wait_seconds_by_tenant": {
            str(tenant): {
                "jobs": len(values),
                "p50": quantile(sorted(values), 0.5),
                "p90": quantile(sorted(values), 0.9),
                "p99": quantile(sorted(values), 0.99),
            }
            for tenant, values in sorted(waits.items())
        },
        "completion_seconds": {"p50": quantile(sorted(completions), 0.5), "p90": quantile(sorted(completions), 0.9)},
        "utilisation_mean": round(sum(s[1] for s in report.samples) / len(report.samples), 4) if report.samples else 0,
        "fragmentation": {
            "idle_cards_on_partly_used_nodes_mean": round(sum(s[2] for s in report.samples) / len(report.samples), 1)
            if report.samples
            else 0,
            "gang_cycles_waiting_with_enough_idle_cards": report.blocked_gang_cycles,
        },
        "reservation_cycles": report.reservations,
        "preemptions": report.preemptions,
        "reclaims": report.reclaims,
        "not_modelled": ["preemption and reclaim", "nodes failing or joining", "load readings"],
    }


def quantile(ordered: Sequence[float], q: float) -> float | None:
    """The q-quantile of sorted values (nearest rank), or None for none."""
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))], 1)
