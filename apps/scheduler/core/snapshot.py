"""What the core takes and gives: the snapshot (cards, nodes, the tasks to place, the
plugin settings) and the decisions and failures it returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from apps.nodes.choices import ExecMode
from apps.slices import planning
from apps.slices.planning import MigModel
from apps.tasks.choices import TaskKind, TaskRuntime


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


@dataclass(frozen=True)
class ModelSpread:
    """Where the models of the inference services waiting in the queue are, by service
    (the replicas' task group id, TaskReq.replica_of): the nodes a model is pinned to
    (Model.nodes; a service absent here: its model is not pinned), and the nodes that
    hold it already (the nodes' own reports, as the registry's "cached on" reads them).
    The snapshot reads it once per cycle and every NodeSnap of it refers to the same one."""

    pinned: Mapping[int, frozenset[str]] = field(default_factory=dict)
    cached: Mapping[int, frozenset[str]] = field(default_factory=dict)


NO_MODELS = ModelSpread()


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
    exec_mode: str = ExecMode.DOCKER  # how its agent runs tasks (the `runtime` filter reads it)
    inference_replicas: int = 0  # the inference replicas it holds (bound, not ended): the cap counts them
    models: ModelSpread = NO_MODELS  # the queue's models: pinned where, cached where

    def model_pinned_away(self, service: int) -> bool:
        """Whether the service's model is pinned to nodes and this is not one of them."""
        pins = self.models.pinned.get(service)
        return pins is not None and self.id not in pins

    def holds_model(self, service: int) -> bool:
        """Whether the node already holds the service's model (no fetch before it starts)."""
        return self.id in self.models.cached.get(service, ())

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
    kind: str = TaskKind.JOB
    # a replica of an inference service: the id of its TaskGroup (placement "replicas"),
    # whose members are placed one by one like single tasks and spread over nodes
    replica_of: int | None = None
    # hard constraints (filters, never scores): the runtime it accepts, the node labels
    # it needs (all of them) and those it avoids (any of them), and whether a replica
    # stays off the nodes holding another replica of its service
    runtime: str = TaskRuntime.AUTO
    affinity_labels: dict = field(default_factory=dict)
    anti_affinity_labels: dict = field(default_factory=dict)
    same_service_apart: bool = False
    # how long it declares it runs (max_duration_seconds; the agent stops it past that):
    # with it, it may backfill cards a waiting gang holds, if it ends before they free up
    max_duration: int | None = None

    @property
    def memory_only(self) -> bool:
        """Only gpu_memory_mb, no whole cards: a share of one card (the slicing path)."""
        return self.gpu_required == 0 and bool(self.gpu_memory_mb)


def constraints(runtime: str, affinity: dict | None, anti_affinity: dict | None) -> dict:
    """TaskReq's constraint fields from a task's (or a group's) stored `runtime`,
    `affinity` and `anti_affinity`."""
    affinity, anti_affinity = affinity or {}, anti_affinity or {}
    return {
        "runtime": runtime or TaskRuntime.AUTO,
        "affinity_labels": affinity.get("nodes_with_labels") or {},
        "anti_affinity_labels": anti_affinity.get("labels") or {},
        "same_service_apart": bool(anti_affinity.get("same_service")),
    }


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
            "model-cache": 1.0,
        }
    )
    enabled: frozenset = frozenset({"topology", "rdma", "nvlink", "replica-spread", "model-cache"})
    gpu_reserve_mb: int = 500
    gpu_reserve_percent: float = 10.0
    gpu_memory_percent_max: float = 95.0
    # load thresholds: a node or card at or above them takes no new work
    cpu_percent_max: float = 90.0
    memory_percent_max: float = 90.0
    gpu_utilization_max: float = 95.0
    gpu_temperature_max: float = 79.0
    preempt_stage: str = "running"  # disabled | scheduled | running (see VICTIM_STATUSES)
    # the most inference replicas one node runs at once (HETEROFLOW_INFERENCE_CONTAINERS_PER_NODE); 0: no cap
    inference_cap: int = 8


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

    message: str = ""  # said when the code alone would not say it (a decision refused at bind)
    queue: Mapping | None = None  # QueueLimit: the queue's figures (core.queues.Admission.detail)

    def as_reason(self) -> dict:
        reason = {"code": self.code, "removed_by": self.removed}
        if self.message:
            reason["message"] = self.message
        if self.queue is not None:
            reason["queue"] = dict(self.queue)
        return reason
