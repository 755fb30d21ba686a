"""The scheduler's pure core: a snapshot in, decisions with reasons out. No database,
no clock, no Django: everything it needs is in the arguments, so it is tested directly.

Pipeline per task (in queue order): the filter chain (FILTERS: available node, tenant
visibility, load, host ports, capacity and cross-tenant sharing, rdma: required, nvlink:
required), then the weighted score of the enabled score plugins; the best node wins
(ties: node id). Each decision is applied to the snapshot at once, so later tasks of the
same cycle see the capacity it took. Placement, its explanation, `fits` and preemption
planning all run the same chain.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from apps.nodes.choices import CORDON_LABEL
from apps.scheduler import nvlink
from apps.slices import planning
from apps.slices.planning import MigModel

NEUTRAL = 50.0


@dataclass(slots=True)
class GpuSnap:
    index: int
    vendor: str
    memory_total_mb: int | None
    lost: bool = False
    memory_used_mb: int | None = None  # live readings, for the load thresholds
    utilization: float | None = None
    temperature: float | None = None
    # current holders: (task id, tenant id, memory MB or None for the whole card); a slice
    # still on the card with no task (releasing, orphaned) is (0, None, its memory): it
    # takes room but serves no tenant
    holders: list[tuple[int, int | None, int | None]] = field(default_factory=list)
    # slicing (apps.slices.planning): a card in MIG mode gives its shares as MIG
    # instances, planned by its model's profile table (None: no table, nothing is
    # planned on it) against the compute and memory slices its LIVE slices take
    mig: bool = False
    mig_model: MigModel | None = None
    model: str = ""  # the card's name as its agent reports it (the MIG table is found by it)
    carved_g: int = 0
    carved_memory: int = 0
    # health (apps.nodes.health, or an operator): a cordoned card takes no new placement
    cordoned: bool = False
    # memory this cycle's decisions put on the card as shares: not in the reading yet
    placed_mb: int = 0

    @property
    def placeable(self) -> bool:
        """Whether the card may take a new placement at all: present and not cordoned.
        Every place that decides a new placement asks this (never `lost` alone)."""
        return not self.lost and not self.cordoned

    @property
    def whole_taken(self) -> bool:
        return any(memory is None for _, _, memory in self.holders)

    def ledger_free_mb(self) -> int:
        """The memory no holder of the ledger has (before any reserve)."""
        return (self.memory_total_mb or 0) - sum(memory or 0 for _, _, memory in self.holders)

    def measured_free_mb(self) -> int | None:
        """The card's total less its latest reading (a reading above the total: 0 free),
        less what this cycle placed on it since; None without a reading (ledger only)."""
        total, used = self.memory_total_mb, self.memory_used_mb
        if used is None or not total:
            return None
        return min(max(total - used, 0), total) - self.placed_mb

    def memory_free_mb(self, reserve_mb: int, measured: bool = True) -> int:
        """A share's free memory: min(ledger-free, measured-free) after the reserve
        (`measured` False: the ledger's alone)."""
        free = self.ledger_free_mb()
        if measured and (seen := self.measured_free_mb()) is not None and seen < free:
            free = seen
        return free - reserve_mb

    def whole_memory_mb(self, measured: bool = True) -> int:
        """The memory a whole-card task would find on this (free) card: its total, or
        less when the reading says some is in use (no reserve: the card is the task's)."""
        total = self.memory_total_mb or 0
        if measured and (seen := self.measured_free_mb()) is not None and seen < total:
            return seen
        return total

    def share_rooms_mb(self, reserve_mb: int) -> tuple[int, int]:
        """share_room_mb with the reading and without it, in one pass over the holders."""
        if self.mig:
            return self.share_room_mb(reserve_mb), self.share_room_mb(reserve_mb, measured=False)
        total = self.memory_total_mb or 0
        holders = self.holders
        ledger = total - sum(memory or 0 for _, _, memory in holders) if holders else total
        used = self.memory_used_mb
        room = ledger
        if used is not None and total:
            seen = (total - used if used < total else 0) - self.placed_mb
            if seen < ledger:
                room = seen
        return room - reserve_mb, ledger - reserve_mb

    def share_room_mb(self, reserve_mb: int, measured: bool = True) -> int:
        """The most memory one more share could have on this card: on a MIG card the
        largest profile that still fits (no reserve: the instance is a partition), less
        any measured use the carved instances do not explain (a process can only use a
        MIG card's memory inside an instance, so use beyond the carved instances' memory
        is something the slices do not know about, and it takes un-carved memory); else
        the free memory after the reserve."""
        if self.mig:
            room = planning.largest_fit_mb(self.mig_model, self.carved_g, self.carved_memory)
            if measured and room and self.memory_used_mb is not None and self.memory_total_mb:
                total, model = self.memory_total_mb, self.mig_model
                carved_mb = self.carved_memory * total // model.memory_slices
                excess = self.memory_used_mb - carved_mb
                if excess > 0 and total - carved_mb - excess < room:
                    # the largest profile that still fits in what the excess leaves
                    left = total - carved_mb - excess
                    room = max(
                        (
                            p.memory_mb
                            for p in model.profiles
                            if p.memory_mb <= left
                            and planning.profile_fits(model, p, self.carved_g, self.carved_memory)
                        ),
                        default=0,
                    )
            return room
        return self.memory_free_mb(reserve_mb, measured)

    def shared_with(self, tenant_id: int, may_share) -> bool:
        """Whether every tenant on the card may share it with `tenant_id` (fail-closed:
        the rule is asked about each holder; a slice with no task serves no tenant)."""
        return all(holder is None or may_share(tenant_id, holder) for _, holder, _ in self.holders)


@dataclass(slots=True)
class NodeSnap:
    id: str
    status: str
    executable: bool
    tenant_id: int | None = None  # None: shared
    labels: dict = field(default_factory=dict)
    region: str = ""
    zone: str = ""
    rack: str = ""
    cpu_used: float | None = None
    memory_used: float | None = None
    gpus: list[GpuSnap] = field(default_factory=list)
    ports_free: int | None = None  # host ports left for inference services; None: not limited

    def usable_gpus(self) -> list[GpuSnap]:
        """The cards present (for the node's utilisation; what may take a new placement
        is GpuSnap.placeable)."""
        return [gpu for gpu in self.gpus if not gpu.lost]

    def gpu_fraction_used(self) -> float | None:
        usable = self.usable_gpus()
        if not usable:
            return None
        return sum(1 for gpu in usable if gpu.holders) / len(usable)


@dataclass(frozen=True)
class TaskReq:
    id: int
    tenant_id: int
    gpu_required: int
    gpu_memory_mb: int | None = None
    gpu_type: str = ""
    priority: int = 50
    labels: dict = field(default_factory=dict)
    kind: str = "job"
    # a replica of an inference service: the id of its TaskGroup (placement "replicas"),
    # whose members are placed one by one like single tasks and spread over nodes
    replica_of: int | None = None

    @property
    def memory_only(self) -> bool:
        """Only gpu_memory_mb, no whole cards: a share of one card (the slicing path)."""
        return self.gpu_required == 0 and bool(self.gpu_memory_mb)


@dataclass(frozen=True)
class PluginSettings:
    layout: str = "spread"  # or "binpack"; the two are mutually exclusive
    weights: dict = field(
        default_factory=lambda: {
            "spread": 1.0,
            "binpack": 1.0,
            "topology": 1.0,
            "rdma": 1.0,
            "nvlink": 1.0,
            "replica-spread": 1.0,
        }
    )
    enabled: frozenset = frozenset({"topology", "rdma", "nvlink", "replica-spread"})
    gpu_reserve_mb: int = 500
    gpu_reserve_percent: float = 10.0
    gpu_memory_percent_max: float = 95.0
    # load thresholds: a node or card at or above them takes no new work
    cpu_percent_max: float = 90.0
    memory_percent_max: float = 90.0
    gpu_utilization_max: float = 95.0
    gpu_temperature_max: float = 79.0
    preempt_stage: str = "running"  # disabled | scheduled | running (see VICTIM_STATUSES)


@dataclass
class Decision:
    task_id: int
    node_id: str
    gpu_indices: list[int]
    memory_mb: int | None  # per card, for memory-only tasks (on a MIG card: the profile's memory)
    score: float


@dataclass
class Failure:
    task_id: int
    code: str  # NoSchedulableNodes | InsufficientResources | NoTenantEligibleGPU
    removed: dict[str, int]  # removal reason -> nodes the chain removed for it

    def as_reason(self) -> dict:
        return {"code": self.code, "removed_by": self.removed}


# --- what the filters check, node by node and card by card ----------------------------------

SCHEDULABLE_STATUSES = frozenset({"online", "suspect"})


def in_service(node: NodeSnap) -> bool:
    """Whether the node may take new tasks at all (before capacity and load)."""
    return node.status in SCHEDULABLE_STATUSES and node.executable and not node.labels.get(CORDON_LABEL)


def reserve_mb(gpu: GpuSnap, settings: PluginSettings) -> int:
    total = gpu.memory_total_mb or 0
    return max(settings.gpu_reserve_mb, int(total * settings.gpu_reserve_percent / 100))


def card_under_load(gpu: GpuSnap, settings: PluginSettings) -> bool:
    """A card below the memory, utilisation and temperature thresholds (a reading the
    agent did not send is not load)."""
    if gpu.memory_total_mb and gpu.memory_used_mb is not None:
        if gpu.memory_used_mb * 100 >= gpu.memory_total_mb * settings.gpu_memory_percent_max:
            return False
    if gpu.utilization is not None and gpu.utilization >= settings.gpu_utilization_max:
        return False
    return gpu.temperature is None or gpu.temperature < settings.gpu_temperature_max


def vendor_matches(gpu: GpuSnap, vendor: str) -> bool:
    return not vendor or gpu.vendor.lower() == vendor


def shareable_cards(node: NodeSnap, task: TaskReq, settings: PluginSettings, may_share) -> list[GpuSnap]:
    """For a memory-only task: the cards with room for it whose every holder may share
    with the task's tenant."""
    vendor = task.gpu_type.lower()
    return [
        gpu
        for gpu in node.gpus
        if gpu.placeable
        and vendor_matches(gpu, vendor)
        and card_under_load(gpu, settings)
        and not gpu.whole_taken
        and gpu.share_room_mb(reserve_mb(gpu, settings)) >= task.gpu_memory_mb
        and gpu.shared_with(task.tenant_id, may_share)
    ]


def overloaded(node: NodeSnap, settings: PluginSettings) -> bool:
    """Missing readings are not load: a node that did not report CPU is not refused for it."""
    return (node.cpu_used is not None and node.cpu_used >= settings.cpu_percent_max) or (
        node.memory_used is not None and node.memory_used >= settings.memory_percent_max
    )


def needed_cards(task: TaskReq) -> int:
    return 1 if task.memory_only else task.gpu_required


# --- score plugins ----------------------------------------------------------------------


def utilisation(node: NodeSnap) -> float:
    parts = [value / 100 for value in (node.cpu_used, node.memory_used) if value is not None]
    gpu = node.gpu_fraction_used()
    if gpu is not None:
        parts.append(gpu)
    return sum(parts) / len(parts) if parts else 0.0


def layout_score(layout: str, used: float) -> float:
    """spread prefers the emptier node, binpack the fuller one."""
    return 100.0 * (used if layout == "binpack" else 1.0 - used)


def score_topology(node: NodeSnap, task: TaskReq) -> float:
    """Base 50; the task's preferred region +5, zone +15, rack +10 (stacking, max 80).
    A node with no location data, or a task with no preference, stays neutral."""
    score = NEUTRAL
    for level, bonus in (("region", 5), ("zone", 15), ("rack", 10)):
        wanted = task.labels.get(level)
        if wanted and getattr(node, level) == wanted:
            score += bonus
    return score


def rdma_state(node: NodeSnap) -> bool | None:
    value = str(node.labels.get("rdma", "")).strip().lower()
    if value in ("true", "yes", "1"):
        return True
    if value in ("false", "no", "0"):
        return False
    return None


def score_rdma(node: NodeSnap) -> float:
    """No label: 50. rdma=true: 70, plus speed/10 (at most +30). Explicitly without: 40."""
    state = rdma_state(node)
    if state is None:
        return NEUTRAL
    if state is False:
        return 40.0
    try:
        speed_bonus = min(float(node.labels.get("rdma-speed", 0)) / 10, 30.0)
    except (TypeError, ValueError):
        speed_bonus = 0.0
    return NEUTRAL + 20 + max(speed_bonus, 0.0)


def score_replica_spread(siblings_here: int) -> float:
    """Anti-affinity of a service's replicas, a soft preference: 100 on a node that runs
    none of the service's other replicas, 50 with one there, 33 with two, … (never a
    filter: a service with more replicas than nodes still places them all)."""
    return 100.0 / (1 + siblings_here)


# --- one cycle --------------------------------------------------------------------------


def pick_cards(cards: Sequence[GpuSnap], count: int) -> list[GpuSnap]:
    """Inside the node: the cards with the fewest holders, then the lowest index."""
    return sorted(cards, key=lambda gpu: (len(gpu.holders), gpu.index))[:count]


def nodes_to_score(total: int) -> int:
    """How many feasible nodes to score per task (as kube-scheduler's
    percentageOfNodesToScore): all of a small fleet, 5 % of a large one, at least 100."""
    return max(100, total * 5 // 100)


def free_whole_cards(node: NodeSnap) -> int:
    # GpuSnap.placeable spelled out: this runs for every node a decision changes
    return sum(1 for gpu in node.gpus if not (gpu.lost or gpu.cordoned or gpu.holders))


_UNKNOWN = object()


class FleetView:
    """Per-cycle bookkeeping that keeps each task's work small. Everything about a node
    that does not depend on the task is computed once per cycle (availability, load,
    the task-independent part of its score; on first use its open cards and the cards
    with room left) and recomputed only for a node whose cards changed (`changed`)."""

    def __init__(
        self,
        nodes: Sequence[NodeSnap],
        settings: PluginSettings,
        may_share: Callable[[int, int], bool],
        scores: bool = True,
    ):
        self.nodes = list(nodes)
        self.scores = scores  # False: a view that is only filtered (fits, preemption)
        self.settings = settings
        self.may_share = may_share
        count = len(self.nodes)
        self._verdicts: dict = {}
        self._gates: dict = {}
        # the one vendor of a node's cards (lower case), or None when they are mixed
        self.vendor = [_single_vendor(node) for node in self.nodes]
        self.free = [0] * count
        self.base_score = [0.0] * count
        self._open: list[list[GpuSnap] | None] = [None] * count
        # cards with room, and how much (on min(ledger-free, measured-free)); and whether a
        # reading is what bounds one of them (else the ledger alone gives the same rooms)
        self._partial: list[list[tuple[GpuSnap, int]] | None] = [None] * count
        self._binds = [False] * count
        self._ledger_partial: list[list[tuple[GpuSnap, int]] | None] = [None] * count
        # whether the node has a cordoned card (present), on first asking: only there is
        # `cordoned` ever the reason
        self._cordoned: list[bool | None] = [None] * count
        self._room: list[dict[tuple, int]] = [{} for _ in self.nodes]
        self._topology: list = [_UNKNOWN if nvlink.TOPOLOGY_LABEL in node.labels else None for node in self.nodes]
        # cards held for a waiting task group this cycle, by position (hold_for_group)
        self.held: dict[int, list[GpuSnap]] = {}
        for position in range(count):
            self.changed(position)

    def verdicts(self, key, verdict: Callable[[NodeSnap], str | None]) -> list[str | None]:
        """`verdict` on every node (a removal reason or None), computed once per cycle
        for each `key`: for the filters whose answer depends only on the node as the
        cycle began and on the key (its tenant, say), not on the cards the cycle takes."""
        found = self._verdicts.get(key)
        if found is None:
            found = self._verdicts[key] = [verdict(node) for node in self.nodes]
        return found

    def gate(self, parts: list[list[str | None]]) -> list[str | None]:
        """Several filters' verdicts as one list: each node's first reason (cached by
        the lists, which live as long as the view)."""
        key = tuple(id(part) for part in parts)
        gate = self._gates.get(key)
        if gate is None:
            gate = parts[0] if parts else [None] * len(self.nodes)
            for later in parts[1:]:
                gate = [reason if reason is not None else then for reason, then in zip(gate, later, strict=True)]
            self._gates[key] = gate
        return gate

    def changed(self, position: int) -> None:
        """The node's cards changed (a decision landed on it, or preemption put a copy
        with fewer holders in its place): recompute what depends on them."""
        node = self.nodes[position]
        self.free[position] = free_whole_cards(node)
        if self.scores:
            weights = self.settings.weights
            layout = self.settings.layout
            score = weights.get(layout, 1.0) * layout_score(layout, utilisation(node))
            if "rdma" in self.settings.enabled:
                score += weights.get("rdma", 1.0) * score_rdma(node)
            self.base_score[position] = score
        self._open[position] = None
        self._partial[position] = None
        self._ledger_partial[position] = None
        self._binds[position] = False
        self._room[position] = {}

    def has_cordoned(self, position: int) -> bool:
        found = self._cordoned[position]
        if found is None:
            found = self._cordoned[position] = any(gpu.cordoned and not gpu.lost for gpu in self.nodes[position].gpus)
        return found

    def open_cards(self, position: int, vendor: str) -> list[GpuSnap]:
        """The node's free whole cards of this vendor ("" any) below the load thresholds."""
        cards = self._open[position]
        if cards is None:
            settings = self.settings
            cards = self._open[position] = [
                gpu
                for gpu in self.nodes[position].gpus
                if not (gpu.lost or gpu.cordoned or gpu.holders) and card_under_load(gpu, settings)
            ]
        if not vendor or vendor == self.vendor[position]:
            return cards
        if self.vendor[position] is not None:
            return []
        return [gpu for gpu in cards if gpu.vendor.lower() == vendor]

    def whole_cards(self, position: int, vendor: str, memory_mb: int | None, measured: bool = True) -> list[GpuSnap]:
        """The open cards a whole-card task could get: of its vendor, with at least its
        gpu_memory_mb each (admission: min(the card's total, what its reading leaves);
        `measured` False: the total alone)."""
        cards = self.open_cards(position, vendor)
        if memory_mb:
            cards = [gpu for gpu in cards if gpu.whole_memory_mb(measured) >= memory_mb]
        return cards

    def room_mb(self, position: int, vendor: str, tenant_id: int | None, measured: bool = True) -> int:
        """The most memory one card of this vendor could still give a memory-only task
        of this tenant (None: whoever holds the cards), on min(ledger-free,
        measured-free) (`measured` False: on the ledger alone, for the explanation).
        Cached per node, so a task's feasibility check is a lookup; its cards are picked
        only on the winning node."""
        cache = self._room[position]
        key = (vendor, tenant_id, measured)
        room = cache.get(key)
        if room is None:
            partial = self._partial[position]
            if partial is None:
                settings = self.settings
                partial = self._partial[position] = []
                ledger_rooms = []
                for gpu in self.nodes[position].gpus:
                    if (
                        not (gpu.lost or gpu.cordoned)  # placeable
                        and not (gpu.holders and gpu.whole_taken)
                        and card_under_load(gpu, settings)
                    ):
                        free, ledger = gpu.share_rooms_mb(reserve_mb(gpu, settings))
                        partial.append((gpu, free))
                        ledger_rooms.append((gpu, ledger))
                        if free != ledger:
                            self._binds[position] = True
                self._ledger_partial[position] = ledger_rooms
            if not measured:
                if not self._binds[position]:
                    return self.room_mb(position, vendor, tenant_id)
                partial = self._ledger_partial[position]
            may_share = self.may_share
            # the most free memory among the cards this tenant may share; a card that
            # cannot beat the best so far is not asked about its holders
            best = None
            for gpu, free in partial:
                if (
                    (best is None or free > best)
                    and vendor_matches(gpu, vendor)
                    and (tenant_id is None or gpu.shared_with(tenant_id, may_share))
                ):
                    best = free
            room = cache[key] = 0 if best is None else best
        return room

    # --- why a node falls short (only asked of a node that does) -------------------------

    def whole_shortfall(self, position: int, ask: Ask) -> str:
        """Why the node lacks the whole cards the task needs: `cordoned` when its
        cordoned cards would have been enough, `memory_in_use` when the ledger would
        admit the task but what the cards' readings say is in use does not, else
        `capacity`."""
        need, vendor, memory = ask.need, ask.vendor, ask.task.gpu_memory_mb
        if self.has_cordoned(position):
            settings = self.settings
            cordoned = sum(
                1
                for gpu in self.nodes[position].gpus
                if gpu.cordoned
                and not gpu.lost
                and not gpu.holders
                and vendor_matches(gpu, vendor)
                and card_under_load(gpu, settings)
                and (not memory or gpu.whole_memory_mb() >= memory)
            )
            if cordoned and len(self.whole_cards(position, vendor, memory)) + cordoned >= need:
                return "cordoned"
        if memory and len(self.whole_cards(position, vendor, memory, measured=False)) >= need:
            return "memory_in_use"
        return "capacity"

    def share_shortfall(self, position: int, ask: Ask) -> str:
        """Why no card of the node has room for the share: `cordoned` when a cordoned
        card would have had it, `tenant_sharing` when only cards the tenant may not share
        would, `memory_in_use` when the ledger would admit it but the reading does not,
        else `capacity`."""
        vendor, memory, tenant = ask.vendor, ask.task.gpu_memory_mb, ask.task.tenant_id
        if self.has_cordoned(position):
            settings = self.settings
            for gpu in self.nodes[position].gpus:
                if (
                    gpu.cordoned
                    and not gpu.lost
                    and not gpu.whole_taken
                    and vendor_matches(gpu, vendor)
                    and card_under_load(gpu, settings)
                    and gpu.share_room_mb(reserve_mb(gpu, settings)) >= memory
                    and gpu.shared_with(tenant, self.may_share)
                ):
                    return "cordoned"
        if self.room_mb(position, vendor, None) >= memory:
            return "tenant_sharing"
        if not self._binds[position]:  # no reading bounds a card here: the ledger says the same
            return "capacity"
        if self.room_mb(position, vendor, tenant, measured=False) >= memory:
            return "memory_in_use"
        if self.room_mb(position, vendor, None, measured=False) >= memory:
            return "tenant_sharing"
        return "capacity"

    def topology(self, position: int) -> nvlink.Topology | None:
        topology = self._topology[position]
        if topology is _UNKNOWN:
            node = self.nodes[position]
            topology = self._topology[position] = nvlink.parse(node.labels, [gpu.index for gpu in node.gpus])
        return topology


def _single_vendor(node: NodeSnap) -> str | None:
    vendors = {gpu.vendor.lower() for gpu in node.gpus}
    return vendors.pop() if len(vendors) == 1 else (None if vendors else "")


# --- the filter chain -------------------------------------------------------------------


@dataclass(slots=True)
class Ask:
    """A task's needs as the filters read them, derived once per task."""

    task: TaskReq
    need: int  # cards: the whole cards, or 1 for a share of one card
    whole: bool  # whole cards (not a share, not a CPU-only task)
    vendor: str  # gpu_type in lower case; "" any
    rdma_required: bool
    nvlink_required: bool

    @classmethod
    def of(cls, task: TaskReq, settings: PluginSettings) -> Ask:
        need = needed_cards(task)
        return cls(
            task,
            need,
            bool(need) and not task.memory_only,
            task.gpu_type.lower(),
            required(task, "rdma", settings),
            required(task, "nvlink", settings),
        )


def required(task: TaskReq, plugin: str, settings: PluginSettings) -> bool:
    """The task's label `<plugin>: required`, when that plugin is enabled."""
    return plugin in settings.enabled and str(task.labels.get(plugin, "")).lower() == "required"


# A check answers, for the node at a position of the fleet, why the chain removes it
# (the reason counted in `removed_by`) or None to let it through. It reads the fleet when
# called: the fleet changes as decisions land.
Check = Callable[[int], "str | None"]
# The verdict on every node of the fleet, by position (FleetView.verdicts).
Verdicts = list


# A filter is a function (ask, fleet) that runs once per task and returns
# - a Check, run once per node;
# - or, when its answer depends only on the node as the cycle began (and on the task
#   through a key: its tenant, say), fleet.verdicts(key, verdict on a node): computed once
#   per cycle, looked up per node;
# - or None when it has nothing to say about this task (a job needs no host port).


def node_available(ask: Ask, fleet: FleetView) -> Verdicts:
    """Online or suspect, executable, not cordoned."""
    return fleet.verdicts("unavailable", lambda node: None if in_service(node) else "unavailable")


def tenant_visible(ask: Ask, fleet: FleetView) -> Verdicts:
    """A dedicated node takes only its tenant's tasks; a shared one (no tenant) anyone's."""
    tenant = ask.task.tenant_id
    return fleet.verdicts(("tenant", tenant), lambda node: "tenant" if node.tenant_id not in (None, tenant) else None)


def under_load(ask: Ask, fleet: FleetView) -> Verdicts:
    """Below the node's CPU and memory thresholds."""
    settings = fleet.settings
    return fleet.verdicts("load", lambda node: "load" if overloaded(node, settings) else None)


def host_port(ask: Ask, fleet: FleetView) -> Check | None:
    """An inference task needs a free host port on the node."""
    if ask.task.kind != "inference":
        return None
    nodes = fleet.nodes
    return lambda position: "ports" if (left := nodes[position].ports_free) is not None and left <= 0 else None


def gpu_capacity(ask: Ask, fleet: FleetView) -> Check | None:
    """Whole cards: enough free cards of the type, under the card thresholds, with
    gpu_memory_mb each. A share: room for gpu_memory_mb on one card after the reserve,
    where every holder may share with the task's tenant (a node where only the sharing
    rule stands in the way counts as tenant_sharing)."""
    need, vendor, memory = ask.need, ask.vendor, ask.task.gpu_memory_mb
    if ask.whole:
        free, open_cards, whole_cards = fleet.free, fleet.open_cards, fleet.whole_cards
        cordoned, shortfall = fleet.has_cordoned, fleet.whole_shortfall
        if not memory:

            def whole(position: int) -> str | None:
                if free[position] >= need and len(open_cards(position, vendor)) >= need:
                    return None
                return shortfall(position, ask) if cordoned(position) else "capacity"

            return whole

        def bounded(position: int) -> str | None:
            if free[position] >= need and len(whole_cards(position, vendor, memory)) >= need:
                return None
            return shortfall(position, ask) if free[position] >= need or cordoned(position) else "capacity"

        return bounded
    if not need:
        return None
    room = fleet.room_mb
    tenant = ask.task.tenant_id

    def check(position: int) -> str | None:
        if room(position, vendor, tenant) >= memory:
            return None
        return fleet.share_shortfall(position, ask)

    return check


def reserved_cards(ask: Ask, fleet: FleetView) -> Check | None:
    """Cards held for a task group that waited too long (hold_for_group) look taken to
    everything behind it in the queue; this names the node `reserved` where those cards
    are what the task lacks (without them it would have had enough), so a task kept off
    by a reservation says so instead of `capacity`. Nothing to say while no card is held."""
    held = fleet.held
    if not held or not ask.whole:
        return None
    need, vendor, memory = ask.need, ask.vendor, ask.task.gpu_memory_mb

    def check(position: int) -> str | None:
        cards = held.get(position)
        if not cards:
            return None
        have = len(fleet.whole_cards(position, vendor, memory))
        if have >= need:
            return None
        back = sum(1 for gpu in cards if vendor_matches(gpu, vendor) and gpu.whole_memory_mb() >= (memory or 0))
        return "reserved" if have + back >= need else None

    return check


def rdma_link(ask: Ask, fleet: FleetView) -> Verdicts | None:
    """`rdma: required` removes the nodes labelled rdma: false (unknown ones pass)."""
    if not ask.rdma_required:
        return None
    return fleet.verdicts("rdma", lambda node: "rdma" if rdma_state(node) is False else None)


def nvlink_domain(ask: Ask, fleet: FleetView) -> Check | None:
    """`nvlink: required` removes the nodes with topology data but no single NVLink
    domain with enough free cards (no data: pass)."""
    if not ask.nvlink_required:
        return None
    need, vendor, memory, whole = ask.need, ask.vendor, ask.task.gpu_memory_mb, ask.whole

    def check(position: int) -> str | None:
        free = [gpu.index for gpu in fleet.whole_cards(position, vendor, memory)] if whole else []
        return None if nvlink.has_domain_for(fleet.topology(position), free, need) else "nvlink"

    return check


Filter = Callable[[Ask, FleetView], "Check | Verdicts | None"]
# The chain, in order: a node is counted under the first filter that removes it. A new
# filter is one function like those above and one line here (gang placement, slices).
FILTERS: tuple[Filter, ...] = (
    node_available,
    tenant_visible,
    under_load,
    host_port,
    reserved_cards,
    gpu_capacity,
    rdma_link,
    nvlink_domain,
)


@dataclass(slots=True)
class Chain:
    """The chain for one task: the verdicts of the filters up to the first per-node
    check merged into one list (`gate`), then the rest in order."""

    gate: list[str | None]
    checks: list[Check]

    @classmethod
    def of(cls, ask: Ask, fleet: FleetView) -> Chain:
        leading: list[list[str | None]] = []
        checks: list[Check] = []
        for make in FILTERS:
            answer = make(ask, fleet)
            if answer is None:
                continue
            if isinstance(answer, Verdicts):
                if not checks:
                    leading.append(answer)
                    continue
                answer = answer.__getitem__
            checks.append(answer)
        return cls(fleet.gate(leading), checks)

    def rejection(self, position: int) -> str | None:
        """Why the chain removes the node at this position, or None when it passes."""
        reason = self.gate[position]
        if reason is None:
            for check in self.checks:
                reason = check(position)
                if reason is not None:
                    break
        return reason


# The order removed_by has always listed the built-in reasons in; a new filter's reasons
# follow them, in the order they were first counted.
REASON_ORDER = {
    reason: rank
    for rank, reason in enumerate(
        (
            "unavailable",
            "tenant",
            "load",
            "capacity",
            "tenant_sharing",
            "rdma",
            "nvlink",
            "ports",
            "cordoned",
            "memory_in_use",
        )
    )
}


def explained(removed: dict[str, int]) -> dict[str, int]:
    return {reason: removed[reason] for reason in sorted(removed, key=lambda r: REASON_ORDER.get(r, len(REASON_ORDER)))}


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


def place_queue(
    queue: Sequence[TaskReq | GroupReq],
    nodes: Sequence[NodeSnap],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    mark: Callable[[], None] | None = None,
    reserving: Mapping[int, Sequence[str]] | None = None,
    held: Sequence[Held] = (),
    siblings: Mapping[int, Mapping[str, int]] | None = None,
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
    `replica-spread` score keeps a service's replicas apart."""
    placement = Placement()
    spread: dict[int, dict[str, int]] = {group: dict(on) for group, on in (siblings or {}).items()}
    decisions, failures = placement.decisions, placement.failures
    fleet = FleetView(nodes, settings, may_share)
    if held:
        hold_again(fleet, held)
    total = len(fleet.nodes)
    limit = nodes_to_score(total)
    start = 0
    for task in queue:
        if mark:
            mark()
        if isinstance(task, GroupReq):
            outcome = place_group(task, fleet)
            if isinstance(outcome, GroupDecision):
                placement.groups.append(outcome)
                continue
            if reserving and task.id in reserving:
                outcome.reservation = hold_for_group(task, fleet, reserving[task.id])
            placement.group_failures.append(outcome)
            continue
        ask = Ask.of(task, settings)
        service = task.replica_of
        here = None if service is None else spread.setdefault(service, {})
        best, removed, examined = search(ask, fleet, start, limit, here)
        # the next task starts where this one stopped looking, so sampling rotates
        start = (start + examined) % total if total else 0
        if best is None:
            failures.append(Failure(task.id, _failure_code(removed, total), explained(removed)))
        else:
            decisions.append(take(ask, fleet, best))
            if here is not None:
                here[best.node_id] = here.get(best.node_id, 0) + 1
    if mark:
        mark()
    return placement


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
    if task.kind == "inference" and node.ports_free is not None:
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


# --- task groups: all workers or none ---------------------------------------------------

# pp puts consecutive stages on different nodes; the others fill a node first (tp needs
# the intra-node links most; the data-parallel ones lose least that way)
SPREAD_STRATEGIES = frozenset({"pp"})
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
    strategy: str = "ddp"
    priority: int = 50
    labels: dict = field(default_factory=dict)
    kind: str = "training"

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

    def as_reason(self) -> dict:
        reason = {
            "code": self.code,
            "message": self.message,
            "removed_by": self.removed,
            "workers": {"placeable": self.placeable, "needed": self.needed, "reach": self.reach},
        }
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
        if group.kind == "inference" and slot.node.ports_free is not None:
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
    if ask.task.kind == "inference" and (ports := fleet.nodes[position].ports_free) is not None:
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
    cards of the type were all free: in service and visible to the tenant (by the chain's
    own availability and tenant filters; with `count_loaded` False, not above the load
    thresholds either, and not `rdma: false` for an `rdma: required` group)."""
    ask = Ask.of(group.worker(), fleet.settings)
    gates = [node_available(ask, fleet), tenant_visible(ask, fleet)]
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


def hold_for_group(group: GroupReq, fleet: FleetView, previous: Sequence[str] = ()) -> Reservation | None:
    """After a reserving group failed to place: choose the nodes it waits for and hold
    their free cards of its type for it, so that nothing behind it in the queue (lower
    priority, or the same priority and younger) takes them; what frees up there is held
    again next cycle, until the target alone can take the whole group.

    The target: the nodes it targeted last cycle (`previous`, kept while they still pass
    availability, tenant and load, so the holds accumulate instead of wandering), then
    the nodes with the most free cards of the type now (closest to done), then the
    largest; each takes as many workers as its cards of the type allow, until the group
    is covered. None when even the empty fleet could not take the group: nothing is held."""
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
    return Reservation(group.id, per_worker, group.world_size, wanted, held)


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


def hold_again(fleet: FleetView, held: Sequence[Held]) -> None:
    """Hold, as the last cycle did, those of the cards still free (a card taken since by
    work ahead of the reservation stays its holder's)."""
    positions = {node.id: position for position, node in enumerate(fleet.nodes)}
    for reservation in held:
        holder = (-reservation.group_id, reservation.tenant_id, None)
        for node_id, indices in reservation.cards.items():
            position = positions.get(node_id)
            if position is None:
                continue
            wanted = set(indices)
            free = [
                gpu for gpu in fleet.nodes[position].gpus if gpu.index in wanted and gpu.placeable and not gpu.holders
            ]
            _hold(fleet, position, free, holder)


# --- preemption -------------------------------------------------------------------------

PREEMPT_STAGES = ("disabled", "scheduled", "running")
# The statuses a victim may be in, per preempt_stage: "running" (the default) takes only
# running tasks; "scheduled" also tasks bound but not yet started.
VICTIM_STATUSES = {
    "disabled": frozenset(),
    "scheduled": frozenset({"scheduled", "starting", "running"}),
    "running": frozenset({"running"}),
}
PREEMPTIBLE_KINDS = frozenset({"job"})  # training and inference are never victims
FREEING = "preempting"


@dataclass(frozen=True, slots=True)
class Occupant:
    """A task that holds cards on a node, as preemption planning sees it."""

    id: int
    node_id: str
    status: str
    kind: str
    preemptible: bool
    priority: int
    created_at: float  # a timestamp: later is newer


@dataclass
class PreemptionPlan:
    task_id: int
    node_id: str
    victims: list[int]  # empty: what is already being freed there is enough; wait


def may_preempt(task: TaskReq, occupant: Occupant, stage: str) -> bool:
    return (
        occupant.kind in PREEMPTIBLE_KINDS
        and occupant.preemptible
        and occupant.priority < task.priority
        and occupant.status in VICTIM_STATUSES[stage]
    )


def _without(node: NodeSnap, gone: set[int]) -> NodeSnap:
    """The node as it would be once the tasks `gone` gave their cards back (a copy; the
    cards none of them holds are shared with the node, never changed). A card's reading
    loses what the ledger says they held there (a whole card: all of it), so measured
    use a victim explains does not stand in the way of its preemptor."""
    return replace(node, gpus=[_card_without(gpu, gone) for gpu in node.gpus])


def _card_without(gpu: GpuSnap, gone: set[int]) -> GpuSnap:
    leaving = [holder for holder in gpu.holders if holder[0] in gone]
    if not leaving:
        return gpu
    used = gpu.memory_used_mb
    if used is not None:
        whole = any(memory is None for _, _, memory in leaving)
        used = 0 if whole else max(used - sum(memory for _, _, memory in leaving), 0)
    return replace(gpu, holders=[holder for holder in gpu.holders if holder[0] not in gone], memory_used_mb=used)


def occupants_by_node(occupants: Sequence[Occupant]) -> dict[str, list[Occupant]]:
    by_node: dict[str, list[Occupant]] = {}
    for occupant in occupants:
        by_node.setdefault(occupant.node_id, []).append(occupant)
    return by_node


def plan_preemption(
    task: TaskReq,
    nodes: Sequence[NodeSnap],
    by_node: dict[str, list[Occupant]],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    taken: set[int] = frozenset(),
) -> PreemptionPlan | None:
    """After a failed placement: the node where evicting the fewest lower-priority
    preemptible tasks makes room. Per node, victims are taken in the order priority
    ascending, newest first, id, and only the shortest prefix that makes the task fit;
    across nodes the fewest victims win, then the smaller priority sum, then node id.
    Cards already being freed (tasks in preempting, or victims chosen this cycle for a
    task ahead in the queue: `taken`) count first and cost nothing: if they are enough,
    the plan has no victims and the task waits for them. None: evicting every candidate
    would not be enough anywhere, so nobody is evicted."""
    if task.kind == "training" or settings.preempt_stage not in VICTIM_STATUSES or settings.preempt_stage == "disabled":
        return None
    occupied = [node for node in nodes if by_node.get(node.id)]
    # the chain, on each node as it would be without the tasks `gone`
    fleet = FleetView(occupied, settings, may_share, scores=False)
    chain = Chain.of(Ask.of(task, settings), fleet)

    def fits_without(position: int, gone: set[int]) -> bool:
        fleet.nodes[position] = _without(occupied[position], gone)
        fleet.changed(position)
        return chain.rejection(position) is None

    best: tuple | None = None
    for position, node in enumerate(occupied):
        here = by_node[node.id]
        freeing = {o.id for o in here if o.status == FREEING or o.id in taken}
        candidates = sorted(
            (o for o in here if o.id not in freeing and may_preempt(task, o, settings.preempt_stage)),
            key=lambda o: (o.priority, -o.created_at, o.id),
        )
        if not freeing and not candidates:
            continue
        if chain.gate[position] is not None:
            continue  # removed whatever it holds (unavailable, another tenant's, loaded)
        gone = set(freeing)
        found = fits_without(position, gone)
        chosen: list[Occupant] = []
        for occupant in candidates:
            if found or (best is not None and len(chosen) >= best[0][0]):
                break  # enough, or already more victims than a plan elsewhere
            chosen.append(occupant)
            gone.add(occupant.id)
            found = fits_without(position, gone)
        if not found:
            continue
        rank = (len(chosen), sum(o.priority for o in chosen), node.id)
        if best is None or rank < best[0]:
            best = (rank, PreemptionPlan(task.id, node.id, [o.id for o in chosen]))
    return best[1] if best else None
