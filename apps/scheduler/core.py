"""The scheduler's pure core: a snapshot in, decisions with reasons out. No database,
no clock, no Django: everything it needs is in the arguments, so it is tested directly.

Pipeline per task (in queue order): the built-in filter chain (available node, tenant
visibility, GPU type, capacity, cross-tenant sharing), the optional plugin filters
(rdma: required), then the weighted score of the enabled score plugins; the best node
wins (ties: node id). Each decision is applied to the snapshot at once, so later tasks
of the same cycle see the capacity it took.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from apps.nodes.choices import CORDON_LABEL
from apps.scheduler import nvlink

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
    # current holders: (task id, tenant id, memory MB or None for the whole card)
    holders: list[tuple[int, int, int | None]] = field(default_factory=list)

    @property
    def whole_taken(self) -> bool:
        return any(memory is None for _, _, memory in self.holders)

    def memory_free_mb(self, reserve_mb: int) -> int:
        total = self.memory_total_mb or 0
        return total - reserve_mb - sum(memory or 0 for _, _, memory in self.holders)


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

    @property
    def memory_only(self) -> bool:
        """Only gpu_memory_mb, no whole cards: a share of one card (the slicing path)."""
        return self.gpu_required == 0 and bool(self.gpu_memory_mb)


@dataclass(frozen=True)
class PluginSettings:
    layout: str = "spread"  # or "binpack"; the two are mutually exclusive
    weights: dict = field(
        default_factory=lambda: {"spread": 1.0, "binpack": 1.0, "topology": 1.0, "rdma": 1.0, "nvlink": 1.0}
    )
    enabled: frozenset = frozenset({"topology", "rdma", "nvlink"})
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
    memory_mb: int | None  # per card, for memory-only tasks
    score: float


@dataclass
class Failure:
    task_id: int
    code: str  # NoSchedulableNodes | InsufficientResources | NoTenantEligibleGPU
    removed: dict[str, int]  # filter name -> nodes it removed

    def as_reason(self) -> dict:
        return {"code": self.code, "removed_by": self.removed}


# --- the built-in filter chain ------------------------------------------------------------

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
        for gpu in node.usable_gpus()
        if vendor_matches(gpu, vendor)
        and card_under_load(gpu, settings)
        and not gpu.whole_taken
        and gpu.memory_free_mb(reserve_mb(gpu, settings)) >= task.gpu_memory_mb
        and all(may_share(task.tenant_id, holder_tenant) for _, holder_tenant, _ in gpu.holders)
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


# --- one cycle --------------------------------------------------------------------------


def pick_cards(cards: Sequence[GpuSnap], count: int) -> list[GpuSnap]:
    """Inside the node: the cards with the fewest holders, then the lowest index."""
    return sorted(cards, key=lambda gpu: (len(gpu.holders), gpu.index))[:count]


def nodes_to_score(total: int) -> int:
    """How many feasible nodes to score per task (as kube-scheduler's
    percentageOfNodesToScore): all of a small fleet, 5 % of a large one, at least 100."""
    return max(100, total * 5 // 100)


def free_whole_cards(node: NodeSnap) -> int:
    return sum(1 for gpu in node.gpus if not gpu.lost and not gpu.holders)


_UNKNOWN = object()


class FleetView:
    """Per-cycle bookkeeping that keeps each task's work small. Everything about a node
    that does not depend on the task is computed once per cycle (availability, load,
    the task-independent part of its score; on first use its open cards and the cards
    with room left) and recomputed only for the node a decision lands on; a task
    needing more whole cards than any node has free fails without a scan."""

    def __init__(self, nodes: Sequence[NodeSnap], settings: PluginSettings):
        self.nodes = list(nodes)
        self.settings = settings
        count = len(self.nodes)
        self.available = [in_service(node) for node in self.nodes]
        self.overloaded = [overloaded(node, settings) for node in self.nodes]
        self.rdma = [rdma_state(node) for node in self.nodes]
        # the one vendor of a node's cards (lower case), or None when they are mixed
        self.vendor = [_single_vendor(node) for node in self.nodes]
        self.free = [0] * count
        self.base_score = [0.0] * count
        self._open: list[list[GpuSnap] | None] = [None] * count
        self._partial: list[list[GpuSnap] | None] = [None] * count
        self._room: list[dict[tuple, int]] = [{} for _ in self.nodes]
        self._topology: list = [_UNKNOWN if nvlink.TOPOLOGY_LABEL in node.labels else None for node in self.nodes]
        for position in range(count):
            self._refresh(position)
        # how many nodes have each number of free cards: max_free without a scan
        self.free_histogram = [0] * (max((len(node.gpus) for node in self.nodes), default=0) + 1)
        for free in self.free:
            self.free_histogram[free] += 1
        self.max_free = self._max_free()

    def _refresh(self, position: int) -> None:
        node = self.nodes[position]
        weights = self.settings.weights
        self.free[position] = free_whole_cards(node)
        layout = self.settings.layout
        score = weights.get(layout, 1.0) * layout_score(layout, utilisation(node))
        if "rdma" in self.settings.enabled:
            score += weights.get("rdma", 1.0) * score_rdma(node)
        self.base_score[position] = score
        self._open[position] = None
        self._partial[position] = None
        self._room[position] = {}

    def _max_free(self) -> int:
        return next((free for free in range(len(self.free_histogram) - 1, -1, -1) if self.free_histogram[free]), 0)

    def open_cards(self, position: int, vendor: str) -> list[GpuSnap]:
        """The node's free whole cards of this vendor ("" any) below the load thresholds."""
        cards = self._open[position]
        if cards is None:
            settings = self.settings
            cards = self._open[position] = [
                gpu
                for gpu in self.nodes[position].gpus
                if not gpu.lost and not gpu.holders and card_under_load(gpu, settings)
            ]
        if not vendor or vendor == self.vendor[position]:
            return cards
        if self.vendor[position] is not None:
            return []
        return [gpu for gpu in cards if gpu.vendor.lower() == vendor]

    def room_mb(self, position: int, vendor: str, tenant_id: int | None, may_share) -> int:
        """The most memory one card of this vendor could still give a memory-only task
        of this tenant (None: whoever holds the cards). Cached per node, so a task's
        feasibility check is a lookup; its cards are picked only on the winning node."""
        cache = self._room[position]
        key = (vendor, tenant_id)
        room = cache.get(key)
        if room is None:
            partial = self._partial[position]
            if partial is None:
                partial = self._partial[position] = [
                    gpu
                    for gpu in self.nodes[position].gpus
                    if not gpu.lost and not gpu.whole_taken and card_under_load(gpu, self.settings)
                ]
            room = cache[key] = max(
                (
                    gpu.memory_free_mb(reserve_mb(gpu, self.settings))
                    for gpu in partial
                    if vendor_matches(gpu, vendor)
                    and (tenant_id is None or all(may_share(tenant_id, holder) for _, holder, _ in gpu.holders))
                ),
                default=0,
            )
        return room

    def topology(self, position: int) -> nvlink.Topology | None:
        topology = self._topology[position]
        if topology is _UNKNOWN:
            node = self.nodes[position]
            topology = self._topology[position] = nvlink.parse(node.labels, [gpu.index for gpu in node.gpus])
        return topology

    def took(self, position: int) -> None:
        self.free_histogram[self.free[position]] -= 1
        self._refresh(position)
        self.free_histogram[self.free[position]] += 1
        self.max_free = self._max_free()


def _single_vendor(node: NodeSnap) -> str | None:
    vendors = {gpu.vendor.lower() for gpu in node.gpus}
    return vendors.pop() if len(vendors) == 1 else (None if vendors else "")


def place(
    tasks: Sequence[TaskReq],
    nodes: Sequence[NodeSnap],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    mark: Callable[[], None] | None = None,
) -> tuple[list[Decision], list[Failure]]:
    """`mark`, if given, is called before each task and once at the end (the benchmark
    times single decisions with it; the core itself reads no clock)."""
    decisions, failures = [], []
    fleet = FleetView(nodes, settings)
    total = len(fleet.nodes)
    limit = nodes_to_score(total)
    weights = settings.weights
    nvlink_on = "nvlink" in settings.enabled
    topology_on = "topology" in settings.enabled
    rdma_on = "rdma" in settings.enabled
    start = 0
    for task in tasks:
        if mark:
            mark()
        removed = {
            "unavailable": 0,
            "tenant": 0,
            "load": 0,
            "capacity": 0,
            "tenant_sharing": 0,
            "rdma": 0,
            "nvlink": 0,
            "ports": 0,
        }
        best: tuple | None = None
        needs_port = task.kind == "inference"
        need = needed_cards(task)
        memory_only = task.memory_only
        whole = bool(need) and not memory_only
        vendor = task.gpu_type.lower()
        rdma_required = rdma_on and str(task.labels.get("rdma", "")).lower() == "required"
        nvlink_required = nvlink_on and str(task.labels.get("nvlink", "")).lower() == "required"
        located = topology_on and any(task.labels.get(level) for level in ("region", "zone", "rack"))
        # the task-dependent parts of the score that are the same on every node
        constant = 0.0
        if topology_on and not located:
            constant += weights.get("topology", 1.0) * NEUTRAL
        if whole and need > fleet.max_free:
            # No node has that many free cards: the answer needs no scan.
            for position in range(total):
                if not fleet.available[position]:
                    removed["unavailable"] += 1
                elif fleet.nodes[position].tenant_id not in (None, task.tenant_id):
                    removed["tenant"] += 1
                elif fleet.overloaded[position]:
                    removed["load"] += 1
                else:
                    removed["capacity"] += 1
            failures.append(Failure(task.id, _failure_code(removed, total), {k: v for k, v in removed.items() if v}))
            continue
        feasible = 0
        examined = 0
        for offset in range(total):
            if feasible >= limit:
                break
            position = (start + offset) % total
            node = fleet.nodes[position]
            examined += 1
            if not fleet.available[position]:
                removed["unavailable"] += 1
                continue
            if node.tenant_id is not None and node.tenant_id != task.tenant_id:
                removed["tenant"] += 1
                continue
            if fleet.overloaded[position]:
                removed["load"] += 1
                continue
            if needs_port and node.ports_free is not None and node.ports_free <= 0:
                removed["ports"] += 1
                continue
            cards: list[GpuSnap] = []
            if whole:
                if fleet.free[position] < need:
                    removed["capacity"] += 1
                    continue
                cards = fleet.open_cards(position, vendor)
                if task.gpu_memory_mb:
                    cards = [gpu for gpu in cards if (gpu.memory_total_mb or 0) >= task.gpu_memory_mb]
                if len(cards) < need:
                    removed["capacity"] += 1
                    continue
            elif need:
                if fleet.room_mb(position, vendor, task.tenant_id, may_share) < task.gpu_memory_mb:
                    sharing = fleet.room_mb(position, vendor, None, may_share) >= task.gpu_memory_mb
                    removed["tenant_sharing" if sharing else "capacity"] += 1
                    continue
            if rdma_required and fleet.rdma[position] is False:
                removed["rdma"] += 1
                continue
            topology = fleet.topology(position) if whole and nvlink_on else None
            free = [gpu.index for gpu in cards] if topology is not None or nvlink_required else None
            if nvlink_required and not nvlink.has_domain_for(fleet.topology(position), free, need):
                removed["nvlink"] += 1
                continue
            feasible += 1
            group = nvlink.choose(topology, free, need) if topology is not None else None
            score = fleet.base_score[position] + constant
            if located:
                score += weights.get("topology", 1.0) * score_topology(node, task)
            if nvlink_on:
                score += weights.get("nvlink", 1.0) * (
                    nvlink.score(topology, free, group) if topology is not None else NEUTRAL
                )
            if best is None or score > best[0] or (score == best[0] and node.id < best[1]):
                best = (score, node.id, position, cards, group)
        # the next task starts where this one stopped looking, so sampling rotates
        start = (start + examined) % total if total else 0
        if best is None:
            failures.append(Failure(task.id, _failure_code(removed, total), {k: v for k, v in removed.items() if v}))
            continue
        score, _, position, cards, group = best
        node = fleet.nodes[position]
        if group is not None:
            by_index = {gpu.index: gpu for gpu in cards}
            chosen = [by_index[index] for index in group]
        elif memory_only:
            chosen = pick_cards(shareable_cards(node, task, settings, may_share), 1)
        else:
            chosen = pick_cards(cards, need)
        memory = task.gpu_memory_mb if memory_only else None
        if needs_port and node.ports_free is not None:
            node.ports_free -= 1
        for gpu in chosen:
            gpu.holders.append((task.id, task.tenant_id, memory))
        if chosen:
            fleet.took(position)
        decisions.append(Decision(task.id, node.id, [gpu.index for gpu in chosen], memory, score))
    if mark:
        mark()
    return decisions, failures


def _failure_code(removed: dict, total: int) -> str:
    if removed["unavailable"] == total:
        return "NoSchedulableNodes"
    if removed["tenant_sharing"] and not removed["capacity"]:
        return "NoTenantEligibleGPU"
    return "InsufficientResources"


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
    """The node as it would be once the tasks `gone` gave their cards back."""
    gpus = [
        GpuSnap(
            gpu.index,
            gpu.vendor,
            gpu.memory_total_mb,
            gpu.lost,
            gpu.memory_used_mb,
            gpu.utilization,
            gpu.temperature,
            [holder for holder in gpu.holders if holder[0] not in gone],
        )
        for gpu in node.gpus
    ]
    return NodeSnap(
        node.id,
        node.status,
        node.executable,
        node.tenant_id,
        node.labels,
        node.region,
        node.zone,
        node.rack,
        node.cpu_used,
        node.memory_used,
        gpus,
    )


def fits(node: NodeSnap, task: TaskReq, settings: PluginSettings, may_share) -> bool:
    """Whether the task's cards could be found on this node as it is (capacity only:
    the node-level filters are the caller's)."""
    need = needed_cards(task)
    if not need:
        return True
    if task.memory_only:
        return bool(shareable_cards(node, task, settings, may_share))
    vendor = task.gpu_type.lower()
    free = [
        gpu.index
        for gpu in node.gpus
        if not gpu.lost
        and not gpu.holders
        and vendor_matches(gpu, vendor)
        and card_under_load(gpu, settings)
        and (gpu.memory_total_mb or 0) >= (task.gpu_memory_mb or 0)
    ]
    if len(free) < need:
        return False
    if "nvlink" in settings.enabled and str(task.labels.get("nvlink", "")).lower() == "required":
        return nvlink.has_domain_for(nvlink.parse(node.labels, [gpu.index for gpu in node.gpus]), free, need)
    return True


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
    rdma_required = "rdma" in settings.enabled and str(task.labels.get("rdma", "")).lower() == "required"
    best: tuple | None = None
    for node in nodes:
        here = by_node.get(node.id)
        if not here:
            continue
        freeing = {o.id for o in here if o.status == FREEING or o.id in taken}
        candidates = sorted(
            (o for o in here if o.id not in freeing and may_preempt(task, o, settings.preempt_stage)),
            key=lambda o: (o.priority, -o.created_at, o.id),
        )
        if not freeing and not candidates:
            continue
        if not in_service(node) or overloaded(node, settings):
            continue
        if node.tenant_id is not None and node.tenant_id != task.tenant_id:
            continue
        if rdma_required and rdma_state(node) is False:
            continue
        if task.kind == "inference" and node.ports_free is not None and node.ports_free <= 0:
            continue  # evicting jobs frees no host port
        gone = set(freeing)
        chosen: list[Occupant] = []
        found = fits(_without(node, gone), task, settings, may_share)
        for occupant in candidates:
            if found or (best is not None and len(chosen) >= best[0][0]):
                break  # enough, or already more victims than a plan elsewhere
            chosen.append(occupant)
            gone.add(occupant.id)
            found = fits(_without(node, gone), task, settings, may_share)
        if not found:
            continue
        rank = (len(chosen), sum(o.priority for o in chosen), node.id)
        if best is None or rank < best[0]:
            best = (rank, PreemptionPlan(task.id, node.id, [o.id for o in chosen]))
    return best[1] if best else None
