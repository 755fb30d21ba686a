"""Task groups: all workers or none (place_group), and the reservation a group that
waited too long holds against everything behind it (hold_for_group, hold_again)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from apps.scheduler import nvlink
from apps.scheduler.core.filters import (
    NODE_CONSTRAINTS,
    Ask,
    Chain,
    explained,
    node_available,
    tenant_visible,
    under_load,
)
from apps.scheduler.core.fleet import FleetView, rdma_state, vendor_matches
from apps.scheduler.core.snapshot import Decision, GpuSnap, NodeSnap, TaskReq
from apps.tasks.choices import GroupKind, GroupStrategy, TaskKind, TaskRuntime

# --- task groups: all workers or none ---------------------------------------------------

# pp puts consecutive stages on different nodes; the others fill a node first (tp needs
# the intra-node links most; the data-parallel ones lose least that way)
SPREAD_STRATEGIES = frozenset({GroupStrategy.PP})
# the spec's batch score of a worker's node against the master's: same rack 3, same
# zone 2, other 0 (the same node counts as the same rack)
RACK_AFFINITY, ZONE_AFFINITY = 3, 2


@dataclass(frozen=True)
class GroupReq:
    """A task group as placement sees it: one task per rank (`members`, rank order), each
    needing `gpus_per_worker` whole cards of exactly `gpu_type`."""

    id: int
    tenant_id: int
    members: tuple[int, ...]
    gpus_per_worker: int
    gpu_type: str
    strategy: str = GroupStrategy.DDP
    priority: int = 50
    labels: dict = field(default_factory=dict)
    kind: str = GroupKind.TRAINING
    # every worker's hard constraints (TaskReq's)
    runtime: str = TaskRuntime.AUTO
    affinity_labels: dict = field(default_factory=dict)
    anti_affinity_labels: dict = field(default_factory=dict)
    # every member's declared duration (None unless all declare one): as TaskReq's
    max_duration: int | None = None

    @property
    def world_size(self) -> int:
        return len(self.members)

    def worker(self, rank: int = 0) -> TaskReq:
        return TaskReq(
            self.members[rank],
            self.tenant_id,
            self.gpus_per_worker,
            None,
            self.gpu_type,
            self.priority,
            self.labels,
            self.kind,
            runtime=self.runtime,
            affinity_labels=self.affinity_labels,
            anti_affinity_labels=self.anti_affinity_labels,
        )


@dataclass
class GroupDecision:
    group_id: int
    decisions: list[Decision]  # by rank; rank 0's node is the master
    score: int  # the batch score: each worker's affinity to the master's node, summed


@dataclass
class Reservation:
    """What a task group that waited too long holds this cycle (hold_for_group): on each
    node of its target set, the cards it wants there (`wanted`, whole workers) and those
    free now and held for it (`held`), which nothing behind it in the queue may take."""

    group_id: int
    gpus_per_worker: int
    needed: int  # workers
    wanted: dict[str, int]  # node -> cards wanted there, in the order the target was chosen
    held: dict[str, list[int]]  # node -> card indices held for the group this cycle
    # when the cards it still lacks are expected free (epoch seconds): the latest of the
    # expected ends of the work on them (a running task's declared duration, else its
    # timeout, from when it started); None when unknown. Work that ends by then may use
    # the held cards meanwhile (backfill).
    expected_free: float | None = None

    @property
    def nodes_held(self) -> int:
        """Target nodes on which every wanted card is held."""
        return sum(1 for node, cards in self.wanted.items() if len(self.held.get(node, ())) >= cards)

    @property
    def workers_held(self) -> int:
        return sum(len(self.held.get(node, ())) // self.gpus_per_worker for node in self.wanted)

    def as_dict(self) -> dict:
        return {
            "nodes": [
                {"node_id": node, "wanted": cards, "held": self.held.get(node, [])}
                for node, cards in self.wanted.items()
            ],
            "nodes_held": self.nodes_held,
            "nodes_needed": len(self.wanted),
            "workers": {"held": self.workers_held, "needed": self.needed},
            "expected_free": self.expected_free,
        }


@dataclass
class GroupFailure:
    group_id: int
    code: str  # GpuTypeNotPresent | NoSchedulableNodes | InsufficientResources | GpuTypeRequired
    message: str
    removed: dict[str, int]
    placeable: int  # workers the fleet could take now
    needed: int
    # workers the tenant's nodes of the type could take if they were empty (in service,
    # visible to the tenant): below `needed`, the group cannot be placed whatever ends
    reach: int = 0
    reservation: Reservation | None = None  # what it holds this cycle, if it reserves
    queue: Mapping | None = None  # QueueLimit: the queue's figures (core.queues.Admission.detail)

    def as_reason(self) -> dict:
        reason = {
            "code": self.code,
            "message": self.message,
            "removed_by": self.removed,
            "workers": {"placeable": self.placeable, "needed": self.needed, "reach": self.reach},
        }
        if self.queue is not None:
            reason["queue"] = dict(self.queue)
        if self.reservation is not None:
            held = self.reservation
            reason |= {
                "code": "Reserved",
                "cause": self.code,
                "message": f"reserved, {held.nodes_held} of {len(held.wanted)} nodes held",
                "reservation": held.as_dict(),
            }
        return reason


@dataclass(slots=True)
class _Slot:
    position: int
    workers: int  # how many workers the node could take
    score: float  # the task-independent part of its score (layout, rdma)
    node: NodeSnap


def place_group(group: GroupReq, fleet: FleetView) -> GroupDecision | GroupFailure:
    """Every worker of the group, or none. The candidates are the nodes that pass the
    normal chain (FILTERS) for one worker; on each, the workers it could take (its open
    cards of the type // gpus_per_worker). Then greedily over the best set: the rack
    (then zone) that can take the most of the group anchors it, its nodes first, then
    the rest of its zone, then the others (the batch score is a soft preference; a group
    that fits anywhere is placed). `pp` spreads the workers one per node first; the other
    strategies fill a node first, and a node that takes the whole group wins outright.
    Inside each node, each worker's cards by the usual NVLink/NUMA choice."""
    needed = group.world_size
    vendor = group.gpu_type.lower()
    ask = Ask.of(group.worker(), fleet.settings)
    chain = Chain.of(ask, fleet)
    removed: dict[str, int] = {}
    slots: list[_Slot] = []
    for position, node in enumerate(fleet.nodes):
        reason = chain.rejection(position)
        if reason is None:
            workers = len(_worker_cards(ask, fleet, position, needed))
            if workers:
                slots.append(_Slot(position, workers, fleet.base_score[position], node))
                continue
            reason = "nvlink" if ask.nvlink_required else "capacity"
        removed[reason] = removed.get(reason, 0) + 1
    placeable = sum(slot.workers for slot in slots)
    if not vendor or placeable < needed:
        return _group_failure(group, fleet, explained(removed), min(placeable, needed))
    plan = _choose_nodes(slots, needed, group.strategy not in SPREAD_STRATEGIES)
    master = plan[0][0].node
    decisions: list[Decision] = []
    score = 0
    for slot, workers in plan:
        affinity = _affinity(master, slot.node)
        groups = _worker_cards(ask, fleet, slot.position, workers)
        by_index = {gpu.index: gpu for gpu in fleet.whole_cards(slot.position, ask.vendor, None)}
        for indices in groups:
            rank = len(decisions)
            task_id = group.members[rank]
            for index in indices:
                by_index[index].holders.append((task_id, group.tenant_id, None))
            decisions.append(Decision(task_id, slot.node.id, indices, None, float(affinity)))
            score += affinity
        if group.kind == GroupKind.INFERENCE and slot.node.ports_free is not None:
            slot.node.ports_free -= workers
        fleet.changed(slot.position)
    return GroupDecision(group.id, decisions, score)


def _worker_cards(ask: Ask, fleet: FleetView, position: int, limit: int) -> list[list[int]]:
    """The cards each of up to `limit` workers would get on the node, worker by worker
    (the NVLink choice with topology data, else the lowest free indices; `nvlink:
    required` stops where no single domain is left for one more)."""
    need = ask.need
    free = [gpu.index for gpu in fleet.whole_cards(position, ask.vendor, None)]
    limit = min(limit, len(free) // need)
    if ask.task.kind == TaskKind.INFERENCE and (ports := fleet.nodes[position].ports_free) is not None:
        limit = min(limit, ports)
    topology = fleet.topology(position) if "nvlink" in fleet.settings.enabled else None
    if topology is None:
        return [free[k * need : (k + 1) * need] for k in range(limit)]
    groups = []
    while len(groups) < limit:
        if ask.nvlink_required and not nvlink.has_domain_for(topology, free, need):
            break
        chosen = nvlink.choose(topology, free, need)
        groups.append(chosen)
        free = [index for index in free if index not in chosen]
    return groups


def _rack_key(node: NodeSnap):
    return (node.region, node.zone, node.rack) if node.rack else ("node", node.id)


def _zone_key(node: NodeSnap):
    return (node.region, node.zone) if node.zone else ("node", node.id)


def _affinity(master: NodeSnap, node: NodeSnap) -> int:
    if node is master or _rack_key(node) == _rack_key(master):
        return RACK_AFFINITY
    if _zone_key(node) == _zone_key(master):
        return ZONE_AFFINITY
    return 0


def _choose_nodes(slots: list[_Slot], needed: int, pack: bool) -> list[tuple[_Slot, int]]:
    """The greedy choice over the candidates: (node, workers on it), master's node first."""
    if pack:
        whole = [slot for slot in slots if slot.workers >= needed]
        if whole:
            best = min(whole, key=lambda slot: (-slot.score, slot.node.id))
            return [(best, needed)]
    racks: dict = defaultdict(int)
    zones: dict = defaultdict(int)
    for slot in slots:
        racks[_rack_key(slot.node)] += slot.workers
        zones[_zone_key(slot.node)] += slot.workers

    def within(slot: _Slot):
        return (-slot.workers, -slot.score, slot.node.id) if pack else (-slot.score, slot.node.id)

    anchor = min(
        slots,
        key=lambda slot: (
            -min(racks[_rack_key(slot.node)], needed),
            -min(zones[_zone_key(slot.node)], needed),
            *within(slot),
        ),
    )
    rack, zone = _rack_key(anchor.node), _zone_key(anchor.node)

    def order(slot: _Slot):
        here_rack, here_zone = _rack_key(slot.node), _zone_key(slot.node)
        tier = 0 if here_rack == rack else 1 if here_zone == zone else 2
        # fill whole racks and zones before starting another
        return (tier, -min(zones[here_zone], needed), -min(racks[here_rack], needed), here_rack, *within(slot))

    ordered = sorted(slots, key=order)
    taken: dict[int, int] = {}
    left = needed
    if pack:
        for slot in ordered:
            if left == 0:
                break
            taken[slot.position] = min(slot.workers, left)
            left -= taken[slot.position]
    else:
        while left:  # one more worker per node per round
            for slot in ordered:
                if left and taken.get(slot.position, 0) < slot.workers:
                    taken[slot.position] = taken.get(slot.position, 0) + 1
                    left -= 1
    return [(slot, taken[slot.position]) for slot in ordered if slot.position in taken]


def _group_failure(group: GroupReq, fleet: FleetView, removed: dict[str, int], placeable: int) -> GroupFailure:
    vendor, needed = group.gpu_type.lower(), group.world_size
    if not vendor:
        return GroupFailure(
            group.id, "GpuTypeRequired", "a group names its gpu_type (never a mix of vendors)", removed, 0, needed
        )
    tenant = group.tenant_id
    present = any(
        node.tenant_id in (None, tenant) and any(gpu.vendor.lower() == vendor for gpu in node.gpus)
        for node in fleet.nodes
    )
    if not present:
        return GroupFailure(group.id, "GpuTypeNotPresent", f"type {group.gpu_type} not present", removed, 0, needed)
    code = "NoSchedulableNodes" if removed.get("unavailable", 0) == len(fleet.nodes) else "InsufficientResources"
    reach = min(sum(workers for _, workers in group_reach(group, fleet)), needed)
    return GroupFailure(
        group.id,
        code,
        f"not enough nodes of type {group.gpu_type} in the tenant's reach: {placeable} of {needed} workers",
        removed,
        placeable,
        needed,
        reach,
    )


def group_reach(group: GroupReq, fleet: FleetView, *, count_loaded: bool = True) -> list[tuple[int, int]]:
    """(position, workers) for each node that could take workers of the group if its
    cards of the type were all free: in service, visible to the tenant and matching the
    group's runtime and node labels (by the chain's own availability, tenant and
    constraint filters; with `count_loaded` False, not above the load thresholds either,
    and not `rdma: false` for an `rdma: required` group)."""
    ask = Ask.of(group.worker(), fleet.settings)
    gates = [node_available(ask, fleet), tenant_visible(ask, fleet)]
    gates += [verdicts for make in NODE_CONSTRAINTS if (verdicts := make(ask, fleet)) is not None]
    if not count_loaded:
        gates.append(under_load(ask, fleet))
    gate = fleet.gate(gates)
    vendor, per_worker = ask.vendor, group.gpus_per_worker
    reach = []
    for position, node in enumerate(fleet.nodes):
        if gate[position] is not None or (not count_loaded and ask.rdma_required and rdma_state(node) is False):
            continue
        workers = sum(1 for gpu in node.gpus if gpu.placeable and vendor_matches(gpu, vendor)) // per_worker
        if workers:
            reach.append((position, workers))
    return reach


# A card held for a reservation carries this pseudo-holder, so every filter, count and
# score after it sees the card taken: (-group id, tenant, whole card). Task ids are
# positive, so it is never mistaken for a task (and never reaches bind or the ledger).
def reservation_holder(group: GroupReq) -> tuple[int, int, None]:
    return (-group.id, group.tenant_id, None)


def hold_for_group(
    group: GroupReq, fleet: FleetView, previous: Sequence[str] = (), ends: Mapping[int, float] | None = None
) -> Reservation | None:
    """After a reserving group failed to place: choose the nodes it waits for and hold
    their free cards of its type for it, so that nothing behind it in the queue (lower
    priority, or the same priority and younger) takes them; what frees up there is held
    again next cycle, until the target alone can take the whole group.

    The target: the nodes it targeted last cycle (`previous`, kept while they still pass
    availability, tenant and load, so the holds accumulate instead of wandering), then
    the nodes with the most free cards of the type now (closest to done), then the
    largest; each takes as many workers as its cards of the type allow, until the group
    is covered. None when even the empty fleet could not take the group: nothing is held.
    `ends` (task id -> its expected end) dates the reservation (`expected_free`)."""
    order = {node_id: k for k, node_id in enumerate(previous)}
    vendor, per_worker = group.gpu_type.lower(), group.gpus_per_worker
    nodes = fleet.nodes

    reach = sorted(
        group_reach(group, fleet, count_loaded=False),
        key=lambda entry: (
            order.get(nodes[entry[0]].id, len(order)),
            -len(fleet.whole_cards(entry[0], vendor, None)),
            -entry[1],
            nodes[entry[0]].id,
        ),
    )
    target: list[tuple[int, int]] = []
    left = group.world_size
    for position, workers in reach:
        if not left:
            break
        take_here = min(workers, left)
        target.append((position, take_here * per_worker))
        left -= take_here
    if left:
        return None
    holder = reservation_holder(group)
    held: dict[str, list[int]] = {}
    for position, cards in target:
        chosen = fleet.whole_cards(position, vendor, None)[:cards]
        held[nodes[position].id] = [gpu.index for gpu in chosen]
        _hold(fleet, position, chosen, holder)
    wanted = {nodes[position].id: cards for position, cards in target}
    short = [(position, cards - len(held[nodes[position].id])) for position, cards in target]
    freed_by = expected_free(fleet, vendor, short, ends)
    return Reservation(group.id, per_worker, group.world_size, wanted, held, freed_by)


def expected_free(
    fleet: FleetView, vendor: str, short: Sequence[tuple[int, int]], ends: Mapping[int, float] | None
) -> float | None:
    """When the cards a reservation still lacks (`short`: per node position, how many
    more of the type it needs there) are expected free: on each node, the soonest-ending
    busy cards of the type, as many as it lacks, end by the latest of them; the
    reservation waits for the slowest node. None when a card's end is unknown (no
    `ends`, a holder without one, a card held by another reservation) or the node has too
    few cards that will free."""
    if ends is None:
        return None
    latest = 0.0
    for position, lacking in short:
        if lacking <= 0:
            continue
        card_ends = []
        for gpu in fleet.nodes[position].gpus:
            if not (gpu.holders and gpu.placeable and vendor_matches(gpu, vendor)):
                continue
            times = [ends.get(holder[0]) if holder[0] > 0 else None for holder in gpu.holders]
            if None in times:
                continue
            card_ends.append(max(times))
        if len(card_ends) < lacking:
            return None
        latest = max(latest, sorted(card_ends)[lacking - 1])
    return latest


def _hold(fleet: FleetView, position: int, cards: list[GpuSnap], holder: tuple) -> None:
    if cards:
        for gpu in cards:
            gpu.holders.append(holder)
        fleet.held.setdefault(position, []).extend(cards)
        fleet.changed(position)


@dataclass(frozen=True)
class Held:
    """Cards a reservation held in the last cycle (as stored on its group), for a dry run
    or an explanation that asks what a request would get now behind it."""

    group_id: int
    tenant_id: int
    cards: dict[str, list[int]]  # node -> card indices
    expected_free: float | None = None  # as Reservation's, from the stored report


def hold_again(fleet: FleetView, held: Sequence[Held]) -> None:
    """Hold, as the last cycle did, those of the cards still free (a card taken since by
    work ahead of the reservation stays its holder's). What is held, as Holdings
    (backfill reads them)."""
    positions = {node.id: position for position, node in enumerate(fleet.nodes)}
    holdings = []
    for reservation in held:
        holding = Holding((-reservation.group_id, reservation.tenant_id, None), {}, reservation.expected_free)
        for node_id, indices in reservation.cards.items():
            position = positions.get(node_id)
            if position is None:
                continue
            wanted = set(indices)
            free = [
                gpu for gpu in fleet.nodes[position].gpus if gpu.index in wanted and gpu.placeable and not gpu.holders
            ]
            _hold(fleet, position, free, holding.holder)
            if free:
                holding.cards[position] = free
        holdings.append(holding)
    return holdings


@dataclass
class Holding:
    """The cards one reservation holds in this cycle's snapshot (node position -> cards),
    its pseudo-holder, and when the cards it still lacks are expected free."""

    holder: tuple
    cards: dict[int, list[GpuSnap]]
    expected_free: float | None
    reservation: Reservation | None = None  # this cycle's (its report follows what backfill takes)

    @classmethod
    def of(cls, group: GroupReq, reservation: Reservation, fleet: FleetView) -> Holding:
        positions = {node.id: position for position, node in enumerate(fleet.nodes)}
        cards = {}
        for node_id, indices in reservation.held.items():
            position = positions[node_id]
            chosen = set(indices)
            cards[position] = [gpu for gpu in fleet.nodes[position].gpus if gpu.index in chosen]
        return cls(reservation_holder(group), cards, reservation.expected_free, reservation)


def backfill(fleet: FleetView, holdings: Sequence[Holding], now: float | None, duration: int | None) -> list:
    """Work that declares its duration and ends (from `now`) before a reservation's cards
    are expected free may use them meanwhile: those reservations' held cards are let go
    for its search (undone by restore_holds, which keeps for each reservation what the
    work did not take). Returns what was let go."""
    if now is None or duration is None or not holdings:
        return []
    ends_by = now + duration
    released = []
    for holding in holdings:
        if holding.expected_free is None or ends_by > holding.expected_free:
            continue
        for position, cards in holding.cards.items():
            for gpu in cards:
                if holding.holder in gpu.holders:
                    gpu.holders.remove(holding.holder)
                    released.append((holding, position, gpu))
            fleet.changed(position)
    return released


def restore_holds(fleet: FleetView, released: list) -> list[tuple[int, int]]:
    """After backfill's search: the cards the work did not take are held again; those it
    took leave their reservation (they free up, by its declared end, before it needs
    them). Returns the taken cards' (position, index)."""
    taken = []
    for holding, position, gpu in released:
        if gpu.holders:
            taken.append((position, gpu.index))
            holding.cards[position] = [card for card in holding.cards[position] if card is not gpu]
            held_here = fleet.held.get(position)
            if held_here is not None:
                fleet.held[position] = [card for card in held_here if card is not gpu]
            if holding.reservation is not None:
                node_id = fleet.nodes[position].id
                indices = holding.reservation.held.get(node_id, [])
                holding.reservation.held[node_id] = [index for index in indices if index != gpu.index]
        else:
            gpu.holders.append(holding.holder)
        fleet.changed(position)
    return taken
