"""The fleet as one cycle sees it: what the filters check node by node and card by card,
the task-independent scores, and FleetView, the per-cycle bookkeeping that keeps each
task's work small."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from apps.nodes.choices import CORDON_LABEL, ExecMode, NodeStatus
from apps.scheduler import nvlink
from apps.scheduler.core.snapshot import GpuSnap, NodeSnap, PluginSettings, TaskReq
from apps.scheduler.load import card_under_load
from apps.tasks.choices import TaskRuntime

if TYPE_CHECKING:
    from apps.scheduler.core.filters import Ask


NEUTRAL = 50.0


# --- what the filters check, node by node and card by card ----------------------------------

SCHEDULABLE_STATUSES = frozenset({NodeStatus.ONLINE, NodeStatus.SUSPECT})


def in_service(node: NodeSnap) -> bool:
    """Whether the node may take new tasks at all (before capacity and load)."""
    return node.status in SCHEDULABLE_STATUSES and node.executable and not node.labels.get(CORDON_LABEL)


# What a node's agent can run, by its exec_mode: a container engine's containers, or
# commands on the host (the process runtime). A node runs one or the other.
RUNS_PROCESSES = frozenset({ExecMode.PROCESS, ExecMode.BAREMETAL})


def runs(node: NodeSnap, runtime: str) -> bool:
    """Whether the node can run a task that accepts `runtime` (TaskRuntime): `container`
    not on a node that runs only processes, `process` only there, `auto` anywhere."""
    if runtime == TaskRuntime.CONTAINER:
        return node.exec_mode not in RUNS_PROCESSES
    if runtime == TaskRuntime.PROCESS:
        return node.exec_mode in RUNS_PROCESSES
    return True


def has_label(node: NodeSnap, key: str, value: str) -> bool:
    """The node carries the label `key` with this value (as text: the labels are JSON)."""
    labels = node.labels
    return key in labels and (labels[key] == value or str(labels[key]) == value)


def reserve_mb(gpu: GpuSnap, settings: PluginSettings) -> int:
    total = gpu.memory_total_mb or 0
    return max(settings.gpu_reserve_mb, int(total * settings.gpu_reserve_percent / 100))


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


# What holding the model is worth: a node that already holds a replica's model scores
# MODEL_CACHED, one that would fetch it first NEUTRAL (times the `model-cache` weight, 1 by
# default). Ten points, what ten points of utilisation are worth to `spread`: it decides
# between otherwise similar nodes, never for a node the filters removed.
MODEL_CACHED = NEUTRAL + 10


def score_model_cache(node: NodeSnap, task: TaskReq) -> float:
    """A replica's node: MODEL_CACHED where its model is cached, else NEUTRAL (and NEUTRAL
    for every task that is not a replica)."""
    service = task.replica_of
    return MODEL_CACHED if service is not None and node.holds_model(service) else NEUTRAL


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
        # each node's free host ports as the cycle began: placement takes one for every
        # inference replica it puts on the node, so the difference is this cycle's replicas
        self._ports_read = [node.ports_free for node in self.nodes]
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

    def inference_replicas(self, position: int) -> int:
        """The inference replicas on the node: those the snapshot read, and those this
        cycle placed there (each took a host port)."""
        node = self.nodes[position]
        read, left = self._ports_read[position], node.ports_free
        return node.inference_replicas + (read - left if read is not None and left is not None else 0)

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
