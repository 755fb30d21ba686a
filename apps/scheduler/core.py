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

from apps.scheduler import nvlink

NEUTRAL = 50.0


@dataclass
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


@dataclass
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

    @property
    def memory_only(self) -> bool:
        """Only gpu_memory_mb, no whole cards: a share of one card (the slicing path)."""
        return self.gpu_required == 0 and bool(self.gpu_memory_mb)


@dataclass(frozen=True)
class PluginSettings:
    layout: str = "spread"  # or "binpack"; the two are mutually exclusive
    weights: dict = field(default_factory=lambda: {"spread": 1.0, "binpack": 1.0, "topology": 1.0, "rdma": 1.0, "nvlink": 1.0})
    enabled: frozenset = frozenset({"topology", "rdma", "nvlink"})
    gpu_reserve_mb: int = 500
    gpu_reserve_percent: float = 10.0
    gpu_memory_percent_max: float = 95.0
    # load thresholds: a node or card at or above them takes no new work
    cpu_percent_max: float = 90.0
    memory_percent_max: float = 90.0
    gpu_utilization_max: float = 95.0
    gpu_temperature_max: float = 79.0


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


def reserve_mb(gpu: GpuSnap, settings: PluginSettings) -> int:
    total = gpu.memory_total_mb or 0
    return max(settings.gpu_reserve_mb, int(total * settings.gpu_reserve_percent / 100))


def eligible_cards(node: NodeSnap, task: TaskReq, settings: PluginSettings, may_share) -> tuple[list[GpuSnap], bool]:
    """The node's cards the task could take, and whether tenant sharing was what ruled
    some out. Whole-card tasks need free cards; memory-only tasks need room on one card
    whose every holder may share with the task's tenant."""
    vendor = task.gpu_type.lower()
    blocked_by_sharing = False
    cards = []
    for gpu in node.usable_gpus():
        if vendor and gpu.vendor.lower() != vendor:
            continue
        if gpu.memory_total_mb and gpu.memory_used_mb is not None:
            if gpu.memory_used_mb * 100 >= gpu.memory_total_mb * settings.gpu_memory_percent_max:
                continue
        if gpu.utilization is not None and gpu.utilization >= settings.gpu_utilization_max:
            continue
        if gpu.temperature is not None and gpu.temperature >= settings.gpu_temperature_max:
            continue
        if task.memory_only:
            if gpu.whole_taken or gpu.memory_free_mb(reserve_mb(gpu, settings)) < task.gpu_memory_mb:
                continue
            if not all(may_share(task.tenant_id, holder_tenant) for _, holder_tenant, _ in gpu.holders):
                blocked_by_sharing = True
                continue
        else:
            if gpu.holders:
                continue
            if task.gpu_memory_mb and (gpu.memory_total_mb or 0) < task.gpu_memory_mb:
                continue
        cards.append(gpu)
    return cards, blocked_by_sharing


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


def score_spread(node: NodeSnap, task: TaskReq) -> float:
    return layout_score("spread", utilisation(node))


def score_binpack(node: NodeSnap, task: TaskReq) -> float:
    return layout_score("binpack", utilisation(node))


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


def score_rdma(node: NodeSnap, task: TaskReq) -> float:
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


def filter_rdma(node: NodeSnap, task: TaskReq) -> bool:
    """`rdma: required` removes nodes that say they have none; unknown nodes pass."""
    if str(task.labels.get("rdma", "")).lower() != "required":
        return True
    return rdma_state(node) is not False


SCORE_PLUGINS: dict[str, Callable[[NodeSnap, TaskReq], float]] = {
    "spread": score_spread,
    "binpack": score_binpack,
    "topology": score_topology,
    "rdma": score_rdma,
}
FILTER_PLUGINS: dict[str, Callable[[NodeSnap, TaskReq], bool]] = {"rdma": filter_rdma}


def active_score_plugins(settings: PluginSettings) -> list[str]:
    return [settings.layout] + sorted(name for name in settings.enabled if name in SCORE_PLUGINS and name not in ("spread", "binpack"))


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


class FleetView:
    """Per-cycle bookkeeping that keeps each task's work small: how many nodes could
    take N whole cards at best (a task needing more fails at once), and each node's
    utilisation, recomputed only when a decision lands on it."""

    def __init__(self, nodes: Sequence[NodeSnap]):
        self.nodes = list(nodes)
        self.free = {node.id: free_whole_cards(node) for node in self.nodes}
        self.utilisation = {node.id: utilisation(node) for node in self.nodes}
        self.max_free = max(self.free.values(), default=0)
        self._topology: dict[str, nvlink.Topology | None] = {}

    def topology(self, node: NodeSnap) -> nvlink.Topology | None:
        if node.id not in self._topology:
            self._topology[node.id] = nvlink.parse(node.labels, [gpu.index for gpu in node.gpus])
        return self._topology[node.id]

    def took(self, node: NodeSnap) -> None:
        self.free[node.id] = free_whole_cards(node)
        self.utilisation[node.id] = utilisation(node)
        self.max_free = max(self.free.values(), default=0)


def place(
    tasks: Sequence[TaskReq],
    nodes: Sequence[NodeSnap],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
) -> tuple[list[Decision], list[Failure]]:
    decisions, failures = [], []
    plugins = active_score_plugins(settings)
    fleet = FleetView(nodes)
    total = len(fleet.nodes)
    limit = nodes_to_score(total)
    start = 0
    for task in tasks:
        removed = {"unavailable": 0, "tenant": 0, "load": 0, "capacity": 0, "tenant_sharing": 0, "rdma": 0, "nvlink": 0}
        best: tuple | None = None
        need = needed_cards(task)
        if need and not task.memory_only and need > fleet.max_free:
            # No node has that many free cards: the answer needs no scan.
            for node in fleet.nodes:
                if node.status not in SCHEDULABLE_STATUSES or not node.executable:
                    removed["unavailable"] += 1
                elif node.tenant_id is not None and node.tenant_id != task.tenant_id:
                    removed["tenant"] += 1
                elif overloaded(node, settings):
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
            node = fleet.nodes[(start + offset) % total]
            examined += 1
            if node.status not in SCHEDULABLE_STATUSES or not node.executable:
                removed["unavailable"] += 1
                continue
            if node.tenant_id is not None and node.tenant_id != task.tenant_id:
                removed["tenant"] += 1
                continue
            if overloaded(node, settings):
                removed["load"] += 1
                continue
            cards: list[GpuSnap] = []
            if need:
                if not task.memory_only and fleet.free[node.id] < need:
                    removed["capacity"] += 1
                    continue
                cards, blocked_by_sharing = eligible_cards(node, task, settings, may_share)
                if len(cards) < need:
                    removed["tenant_sharing" if blocked_by_sharing else "capacity"] += 1
                    continue
            if "rdma" in settings.enabled and not filter_rdma(node, task):
                removed["rdma"] += 1
                continue
            topology = fleet.topology(node) if need and not task.memory_only and "nvlink" in settings.enabled else None
            free = [gpu.index for gpu in cards]
            if str(task.labels.get("nvlink", "")).lower() == "required" and "nvlink" in settings.enabled:
                if not nvlink.has_domain_for(fleet.topology(node), free, need):
                    removed["nvlink"] += 1
                    continue
            feasible += 1
            group = nvlink.choose(topology, free, need) if topology is not None else None
            score = sum(settings.weights.get(name, 1.0) * _score(name, node, task, fleet) for name in plugins)
            if "nvlink" in settings.enabled:
                score += settings.weights.get("nvlink", 1.0) * nvlink.score(topology, free, group or [])
            if best is None or score > best[0] or (score == best[0] and node.id < best[1]):
                best = (score, node.id, node, cards, group)
        # the next task starts where this one stopped looking, so sampling rotates
        start = (start + examined) % total if total else 0
        if best is None:
            failures.append(Failure(task.id, _failure_code(removed, total), {k: v for k, v in removed.items() if v}))
            continue
        score, _, node, cards, group = best
        if group is not None:
            by_index = {gpu.index: gpu for gpu in cards}
            chosen = [by_index[index] for index in group]
        else:
            chosen = pick_cards(cards, need)
        memory = task.gpu_memory_mb if task.memory_only else None
        for gpu in chosen:
            gpu.holders.append((task.id, task.tenant_id, memory))
        if chosen:
            fleet.took(node)
        decisions.append(Decision(task.id, node.id, [gpu.index for gpu in chosen], memory, score))
    return decisions, failures


def _score(name: str, node: NodeSnap, task: TaskReq, fleet: FleetView) -> float:
    if name in ("spread", "binpack"):
        return layout_score(name, fleet.utilisation[node.id])  # cached per cycle
    return SCORE_PLUGINS[name](node, task)


def _failure_code(removed: dict, total: int) -> str:
    if removed["unavailable"] == total:
        return "NoSchedulableNodes"
    if removed["tenant_sharing"] and not removed["capacity"]:
        return "NoTenantEligibleGPU"
    return "InsufficientResources"
