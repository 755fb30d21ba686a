"""Placement: the queue in its order, each single task on its best node (the chain, then
the weighted score), each group whole or not at all, every decision applied to the
snapshot before the next; and the explanation's detail, and `fits`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from apps.scheduler import nvlink
from apps.scheduler.core.filters import Ask, Chain, explained
from apps.scheduler.core.fleet import (
    NEUTRAL,
    FleetView,
    has_label,
    reserve_mb,
    runs,
    score_model_cache,
    score_replica_spread,
    score_topology,
    shareable_cards,
    vendor_matches,
)
from apps.scheduler.core.groups import (
    GroupDecision,
    GroupFailure,
    GroupReq,
    Held,
    Holding,
    backfill,
    hold_again,
    hold_for_group,
    place_group,
    restore_holds,
)
from apps.scheduler.core.queues import QUEUE_LIMIT, QueueBook, admitted_types, card_share, fair_share_order
from apps.scheduler.core.snapshot import Decision, Failure, GpuSnap, NodeSnap, PluginSettings, TaskReq
from apps.slices import planning
from apps.tasks.choices import TaskKind, TaskRuntime


def pick_cards(cards: Sequence[GpuSnap], count: int) -> list[GpuSnap]:
    """Inside the node: the cards with the fewest holders, then the lowest index."""
    return sorted(cards, key=lambda gpu: (len(gpu.holders), gpu.index))[:count]


def nodes_to_score(total: int) -> int:
    """How many feasible nodes to score per task (as kube-scheduler's
    percentageOfNodesToScore): all of a small fleet, 5 % of a large one, at least 100."""
    return max(100, total * 5 // 100)


@dataclass(slots=True)
class Candidate:
    """The best feasible node so far for a task."""

    score: float
    node_id: str
    position: int
    group: list[int] | None  # the cards of the NVLink group it would get, with topology data


def place(
    tasks: Sequence[TaskReq],
    nodes: Sequence[NodeSnap],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    mark: Callable[[], None] | None = None,
    siblings: Mapping[int, Mapping[str, int]] | None = None,
) -> tuple[list[Decision], list[Failure]]:
    """`mark`, if given, is called before each task and once at the end (the benchmark
    times single decisions with it; the core itself reads no clock). `siblings`: as for
    place_queue."""
    placement = place_queue(tasks, nodes, settings, may_share, mark, siblings=siblings)
    return placement.decisions, placement.failures


@dataclass
class Placement:
    """A cycle's decisions: single tasks, and task groups placed whole."""

    decisions: list[Decision] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    groups: list[GroupDecision] = field(default_factory=list)
    group_failures: list[GroupFailure] = field(default_factory=list)
    # for each service with a replica in the queue: node id -> its replicas there, those
    # bound before the cycle and those it placed (preemption planning reads it)
    siblings: dict[int, dict[str, int]] = field(default_factory=dict)
    # the work placed on cards a waiting gang held (backfill): task or group id -> the
    # cards it took there, (node id, index)
    backfilled: dict[int, list[tuple[str, int]]] = field(default_factory=dict)


def place_queue(
    queue: Sequence[TaskReq | GroupReq],
    nodes: Sequence[NodeSnap],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    mark: Callable[[], None] | None = None,
    reserving: Mapping[int, Sequence[str]] | None = None,
    held: Sequence[Held] = (),
    siblings: Mapping[int, Mapping[str, int]] | None = None,
    book: QueueBook | None = None,
    now: float | None = None,
    ends: Mapping[int, float] | None = None,
) -> Placement:
    """The queue in its order (single tasks and groups interleaved by priority): each
    single task on its best node, each group whole or not at all (`place_group`), every
    decision applied to the snapshot before the next item is decided. A group named in
    `reserving` (id -> the nodes it targeted last cycle) that does not fit holds the free
    cards it waits for (`hold_for_group`) against everything after it in the queue.
    `held`: reservations already standing in front of the whole queue (a dry run's).
    `siblings`: for the services whose replicas are in the queue (TaskReq.replica_of),
    how many of their other replicas each node holds already (group id -> node id ->
    count); the replicas placed in this cycle are added as they land, so the
    `replica-spread` score keeps a service's replicas apart (and `same_service` keeps
    them off each other's nodes). `book`: the tenants' queues (core.queues): the queue
    is tried in their fair-share order, an item its tenant's queue does not admit fails
    with QUEUE_LIMIT and the queue's words, and what is placed is taken from it.
    `now` and `ends` (epoch seconds; task id -> when the work holding cards is expected
    to end): backfill. A reservation is dated by `ends` (when the cards it lacks free
    up), and work that declares its duration (max_duration) and ends by then may take
    the cards it holds meanwhile. Without them nothing is backfilled."""
    placement = Placement()
    spread = placement.siblings
    spread.update((group, dict(on)) for group, on in (siblings or {}).items())
    decisions, failures = placement.decisions, placement.failures
    fleet = FleetView(nodes, settings, may_share)
    holdings: list[Holding] = hold_again(fleet, held) if held else []
    total = len(fleet.nodes)
    limit = nodes_to_score(total)
    start = 0
    queues = book if book is not None and book.specs else None
    if queues is not None:
        queue = fair_share_order(queue, queues)
        vendors = sorted({gpu.vendor.lower() for node in nodes for gpu in node.gpus})
    for task in queue:
        if mark:
            mark()
        if isinstance(task, GroupReq):
            if queues is not None and task.tenant_id in queues.specs:
                verdict = queues.admit(task.tenant_id, task.gpu_type, float(task.world_size * task.gpus_per_worker))
                if not verdict.admitted:
                    placement.group_failures.append(
                        GroupFailure(task.id, QUEUE_LIMIT, verdict.words, {}, 0, task.world_size, queue=verdict.detail)
                    )
                    continue
            released = backfill(fleet, holdings, now, task.max_duration)
            outcome = place_group(task, fleet)
            if released:
                taken = restore_holds(fleet, released)
                if taken and isinstance(outcome, GroupDecision):
                    placement.backfilled[task.id] = [(fleet.nodes[position].id, index) for position, index in taken]
            if isinstance(outcome, GroupDecision):
                placement.groups.append(outcome)
                if queues is not None:
                    queues.take(task.tenant_id, task.gpu_type, float(task.world_size * task.gpus_per_worker))
                continue
            if reserving and task.id in reserving:
                outcome.reservation = hold_for_group(task, fleet, reserving[task.id], ends)
                if outcome.reservation is not None:
                    holdings.append(Holding.of(task, outcome.reservation, fleet))
            if queues is not None:
                cards = float(task.world_size * task.gpus_per_worker)
                queues.found_no_room(task.tenant_id, task.gpu_type, cards)
                behind = queues.behind(task.tenant_id, task.gpu_type, cards)
                if behind is not None and outcome.reservation is None:
                    outcome = replace(outcome, message=f"{outcome.message}; {behind.words}", queue=behind.detail)
            placement.group_failures.append(outcome)
            continue
        service = task.replica_of
        here = None if service is None else spread.setdefault(service, {})
        queued = queues is not None and task.tenant_id in queues.specs
        if queued:
            admitted, refusal = admitted_types(
                queues, task.tenant_id, [task.gpu_type] if task.gpu_type else vendors, float(task.gpu_required)
            )
            if not admitted:
                failures.append(Failure(task.id, QUEUE_LIMIT, {}, refusal.words, refusal.detail))
                continue
            if not task.gpu_type and len(admitted) < len(vendors):
                task = _one_of(task, admitted, fleet, settings, start, limit, here)  # noqa: PLW2901
        ask = Ask.of(task, settings, here)
        released = backfill(fleet, holdings, now, task.max_duration)
        best, removed, examined = search(ask, fleet, start, limit, here)
        # the next task starts where this one stopped looking, so sampling rotates
        start = (start + examined) % total if total else 0
        if best is None:
            if released:
                restore_holds(fleet, released)
            failure = Failure(task.id, _failure_code(removed, total), explained(removed))
            if queued:
                queues.found_no_room(task.tenant_id, task.gpu_type, float(task.gpu_required))
                behind = queues.behind(task.tenant_id, task.gpu_type, float(task.gpu_required))
                if behind is not None:
                    failure = replace(failure, message=behind.words, queue=behind.detail)
            failures.append(failure)
            continue
        if queued and task.memory_only:  # a share counts as its share of the card it lands on
            gpu_type, share = _share_on(fleet.nodes[best.position], task)
            verdict = queues.admit(task.tenant_id, gpu_type, share)
            if not verdict.admitted:
                if released:
                    restore_holds(fleet, released)
                failures.append(Failure(task.id, QUEUE_LIMIT, {}, verdict.words, verdict.detail))
                continue
        decision = take(ask, fleet, best)
        if released:
            taken = restore_holds(fleet, released)
            if taken:
                placement.backfilled[task.id] = [(fleet.nodes[position].id, index) for position, index in taken]
        decisions.append(decision)
        if here is not None:
            here[best.node_id] = here.get(best.node_id, 0) + 1
        if queued:
            node = fleet.nodes[best.position]
            for gpu in node.gpus:
                if gpu.index in decision.gpu_indices:
                    queues.take(task.tenant_id, gpu.vendor.lower(), card_share(gpu, decision.memory_mb))
    if mark:
        mark()
    return placement


def _one_of(
    task: TaskReq,
    gpu_types: Sequence[str],
    fleet: FleetView,
    settings: PluginSettings,
    start: int,
    limit: int,
    here: Mapping[str, int] | None,
) -> TaskReq:
    """A task that takes any vendor, of which its queue admits only some: the task bound
    to the admitted type whose best node scores highest (the first when none fits, so
    its failure names a type the queue admits)."""
    best_type, best_score = gpu_types[0], None
    for gpu_type in gpu_types:
        found, _, _ = search(Ask.of(replace(task, gpu_type=gpu_type), settings, here), fleet, start, limit, here)
        if found is not None and (best_score is None or found.score > best_score):
            best_type, best_score = gpu_type, found.score
    return replace(task, gpu_type=best_type)


def _share_on(node: NodeSnap, task: TaskReq) -> tuple[str, float]:
    """A memory-only task's GPU type and share on `node`: its memory over the node's
    largest card of its type (at most 1)."""
    cards = [gpu for gpu in node.gpus if not task.gpu_type or vendor_matches(gpu, task.gpu_type)] or node.gpus
    card = max(cards, key=lambda gpu: gpu.memory_total_mb or 0)
    return card.vendor.lower(), card_share(card, task.gpu_memory_mb or 0)


def search(
    ask: Ask, fleet: FleetView, start: int, limit: int, siblings: Mapping[str, int] | None = None
) -> tuple[Candidate | None, dict[str, int], int]:
    """The nodes from `start` on, round the fleet, through the chain; the feasible ones
    are scored, until `limit` were found. Returns the best, the removal counts and how
    many nodes were looked at. `siblings` (a replica's: node id -> the service's other
    replicas there) adds the `replica-spread` score."""
    chain = Chain.of(ask, fleet)
    gate, checks = chain.gate, chain.checks
    task, settings = ask.task, fleet.settings
    weights = settings.weights
    nvlink_on = "nvlink" in settings.enabled
    topology_on = "topology" in settings.enabled
    located = topology_on and any(task.labels.get(level) for level in ("region", "zone", "rack"))
    # the task-dependent parts of the score that are the same on every node
    constant = weights.get("topology", 1.0) * NEUTRAL if topology_on and not located else 0.0
    topology_weight, nvlink_weight = weights.get("topology", 1.0), weights.get("nvlink", 1.0)
    apart = siblings is not None and "replica-spread" in settings.enabled
    apart_weight = weights.get("replica-spread", 1.0)
    # a replica prefers the nodes that hold its model (NEUTRAL elsewhere, the same on every node)
    cached_on = task.replica_of is not None and "model-cache" in settings.enabled
    cache_weight = weights.get("model-cache", 1.0)
    nodes, base_score = fleet.nodes, fleet.base_score
    whole, need, vendor, memory = ask.whole, ask.need, ask.vendor, task.gpu_memory_mb
    removed: dict[str, int] = {}
    best: Candidate | None = None
    feasible = examined = 0
    for position in itertools.chain(range(start, len(nodes)), range(start)):
        if feasible >= limit:
            break
        examined += 1
        reason = gate[position]
        if reason is None:
            for check in checks:
                reason = check(position)
                if reason is not None:
                    break
        if reason is not None:
            removed[reason] = removed.get(reason, 0) + 1
        else:
            feasible += 1
            topology = fleet.topology(position) if whole and nvlink_on else None
            group = None
            score = base_score[position] + constant
            if located:
                score += topology_weight * score_topology(nodes[position], task)
            if nvlink_on:
                if topology is not None:
                    free = [gpu.index for gpu in fleet.whole_cards(position, vendor, memory)]
                    group = nvlink.choose(topology, free, need)
                    score += nvlink_weight * nvlink.score(topology, free, group)
                else:
                    score += nvlink_weight * NEUTRAL
            node_id = nodes[position].id
            if apart:
                score += apart_weight * score_replica_spread(siblings.get(node_id, 0))
            if cached_on:
                score += cache_weight * score_model_cache(nodes[position], task)
            if best is None or score > best.score or (score == best.score and node_id < best.node_id):
                best = Candidate(score, node_id, position, group)
    return best, removed, examined


def take(ask: Ask, fleet: FleetView, best: Candidate) -> Decision:
    """Place the task on the best node: pick its cards and record it as their holder."""
    task = ask.task
    node = fleet.nodes[best.position]
    cards = fleet.whole_cards(best.position, ask.vendor, task.gpu_memory_mb) if ask.whole else []
    if best.group is not None:
        by_index = {gpu.index: gpu for gpu in cards}
        chosen = [by_index[index] for index in best.group]
    elif task.memory_only:
        chosen = pick_cards(shareable_cards(node, task, fleet.settings, fleet.may_share), 1)
    else:
        chosen = pick_cards(cards, ask.need)
    memory = task.gpu_memory_mb if task.memory_only else None
    if task.kind == TaskKind.INFERENCE and node.ports_free is not None:
        node.ports_free -= 1
    for gpu in chosen:
        if memory is not None:
            if gpu.mig:
                memory = carve_mig(gpu, memory)
            gpu.placed_mb += memory  # the reading does not show it yet
        gpu.holders.append((task.id, task.tenant_id, memory))
    if chosen:
        fleet.changed(best.position)
    return Decision(task.id, node.id, [gpu.index for gpu in chosen], memory, best.score)


def carve_mig(gpu: GpuSnap, memory_mb: int) -> int:
    """Take the smallest fitting MIG profile for a share on this card (the room check
    said one fits); returns the profile's memory, which is what the ledger holds."""
    profile = planning.choose_profile(gpu.mig_model, memory_mb, gpu.carved_g, gpu.carved_memory)
    gpu.carved_g += profile.g
    gpu.carved_memory += profile.memory_slices
    return profile.memory_mb


def _failure_code(removed: dict, total: int) -> str:
    if removed.get("unavailable", 0) == total:
        return "NoSchedulableNodes"
    if removed.get("tenant_sharing") and not removed.get("capacity"):
        return "NoTenantEligibleGPU"
    return "InsufficientResources"


def memory_detail(
    task: TaskReq, nodes: Sequence[NodeSnap], settings: PluginSettings, may_share, limit: int = 50
) -> list[dict]:
    """For the explanation only (never the cycle): the cards where what the readings say
    is in use is what keeps a memory-bounded task off (the ledger would admit it), each
    with both numbers: the ledger's free memory and the measured free memory (before the
    reserve), the reserve (a share's; 0 for a whole card, which is the task's alone) and
    what the task needs. On the nodes that pass availability, tenant and load; at most
    `limit` cards."""
    memory = task.gpu_memory_mb
    if not memory:
        return []
    ask = Ask.of(task, settings)
    fleet = FleetView(nodes, settings, may_share, scores=False)
    gate = Chain.of(ask, fleet).gate
    found: list[dict] = []
    for position, node in enumerate(fleet.nodes):
        if gate[position] is not None:
            continue
        if ask.whole:
            for gpu in fleet.open_cards(position, ask.vendor):
                if gpu.whole_memory_mb(measured=False) >= memory > gpu.whole_memory_mb():
                    found.append(_card_detail(node, gpu, gpu.memory_total_mb or 0, 0, memory))
        else:
            for gpu in shareable_cards(node, replace(task, gpu_memory_mb=0), settings, may_share):
                reserve = 0 if gpu.mig else reserve_mb(gpu, settings)
                if gpu.share_room_mb(reserve, measured=False) >= memory > gpu.share_room_mb(reserve):
                    ledger = gpu.share_room_mb(0, measured=False) if gpu.mig else gpu.ledger_free_mb()
                    found.append(_card_detail(node, gpu, ledger, reserve, memory))
        if len(found) >= limit:
            break
    return found[:limit]


def rejections(
    task: TaskReq,
    nodes: Sequence[NodeSnap],
    settings: PluginSettings,
    may_share,
    siblings: Mapping[str, int] | None = None,
    limit: int = 100,
) -> list[dict]:
    """For the explanation only (never the cycle): each node the chain removes for the
    task, in node id order, with the filter that removed it (the reason counted in
    `removed_by`), at most `limit`."""
    fleet = FleetView(nodes, settings, may_share, scores=False)
    chain = Chain.of(Ask.of(task, settings, siblings), fleet)
    found = []
    for position in sorted(range(len(fleet.nodes)), key=lambda position: fleet.nodes[position].id):
        reason = chain.rejection(position)
        if reason is not None:
            found.append({"node_id": fleet.nodes[position].id, "filter": reason})
            if len(found) >= limit:
                break
    return found


def constraint_words(task: TaskReq, nodes: Sequence[NodeSnap], removed: Mapping[str, int]) -> list[str]:
    """For the explanation only: in words, how the task's hard constraints (its runtime,
    its node labels, its service's other replicas) kept the nodes counted in `removed`
    off, naming a wanted label that no node of the snapshot carries at all."""
    words = []

    def nodes_word(count: int) -> str:
        return f"{count} node{'s' if count != 1 else ''}"

    if removed.get("runtime"):
        if task.runtime == TaskRuntime.PROCESS:
            able = sum(1 for node in nodes if runs(node, task.runtime))
            words.append(
                f"runtime process: {nodes_word(removed['runtime'])} run tasks only in containers"
                + ("" if able else "; no schedulable node runs processes (an agent with the process runtime)")
            )
        else:
            words.append(f"runtime container: {nodes_word(removed['runtime'])} run only processes, no containers")
    if removed.get("affinity"):
        wanted = task.affinity_labels
        absent = [f"{key}={value}" for key, value in wanted.items() if not any(has_label(n, key, value) for n in nodes)]
        if absent:
            plural = "s" if len(absent) > 1 else ""
            words.append(f"affinity: no schedulable node has the label{plural} {', '.join(absent)}")
        else:
            labels = ", ".join(f"{key}={value}" for key, value in wanted.items())
            words.append(f"affinity: {nodes_word(removed['affinity'])} lack at least one of {labels}")
    if removed.get("anti_affinity"):
        labels = ", ".join(f"{key}={value}" for key, value in task.anti_affinity_labels.items())
        words.append(f"anti-affinity: {nodes_word(removed['anti_affinity'])} carry a label it avoids ({labels})")
    if removed.get("same_service"):
        words.append(f"anti-affinity: {nodes_word(removed['same_service'])} already hold a replica of its service")
    return words


def _card_detail(node: NodeSnap, gpu: GpuSnap, ledger_free: int, reserve: int, needed: int) -> dict:
    measured = gpu.measured_free_mb()
    return {
        "node_id": node.id,
        "gpu_index": gpu.index,
        "ledger_free_mb": ledger_free,
        "measured_free_mb": measured,
        "reserve_mb": reserve,
        "needed_mb": needed,
    }


def fits(node: NodeSnap, task: TaskReq, settings: PluginSettings, may_share) -> bool:
    """Whether the chain lets the task onto this node as it is."""
    return Chain.of(Ask.of(task, settings), FleetView([node], settings, may_share, scores=False)).rejection(0) is None
