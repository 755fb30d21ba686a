"""The filter chain (FILTERS): what removes a node for a task, and why. Placement, its
explanation, `fits`, group placement and preemption planning all run this chain."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from apps.scheduler import nvlink
from apps.scheduler.core.fleet import FleetView, has_label, in_service, needed_cards, rdma_state, runs, vendor_matches
from apps.scheduler.core.snapshot import PluginSettings, TaskReq
from apps.scheduler.load import overloaded
from apps.tasks.choices import TaskKind, TaskRuntime

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
    # a replica's: node id -> how many of its service's other replicas the node holds
    # (those bound, and those placed earlier in the cycle); None: not known here
    siblings: Mapping[str, int] | None = None

    @classmethod
    def of(cls, task: TaskReq, settings: PluginSettings, siblings: Mapping[str, int] | None = None) -> Ask:
        need = needed_cards(task)
        return cls(
            task,
            need,
            bool(need) and not task.memory_only,
            task.gpu_type.lower(),
            required(task, "rdma", settings),
            required(task, "nvlink", settings),
            siblings,
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


def runtime_mode(ask: Ask, fleet: FleetView) -> Verdicts | None:
    """`runtime: container` removes the nodes that run only processes, `runtime: process`
    the nodes that do not run processes (by the node's exec_mode); `auto` passes all."""
    runtime = ask.task.runtime
    if runtime == TaskRuntime.AUTO:
        return None
    return fleet.verdicts(("runtime", runtime), lambda node: None if runs(node, runtime) else "runtime")


def node_affinity(ask: Ask, fleet: FleetView) -> Verdicts | None:
    """`affinity.nodes_with_labels`: only the nodes that carry every one of the labels."""
    wanted = ask.task.affinity_labels
    if not wanted:
        return None
    pairs = tuple(sorted(wanted.items()))
    return fleet.verdicts(
        ("affinity", pairs),
        lambda node: None if all(has_label(node, key, value) for key, value in pairs) else "affinity",
    )


def label_anti_affinity(ask: Ask, fleet: FleetView) -> Verdicts | None:
    """`anti_affinity.labels`: never a node that carries any of the labels."""
    avoided = ask.task.anti_affinity_labels
    if not avoided:
        return None
    pairs = tuple(sorted(avoided.items()))
    return fleet.verdicts(
        ("anti_affinity", pairs),
        lambda node: "anti_affinity" if any(has_label(node, key, value) for key, value in pairs) else None,
    )


def same_service(ask: Ask, fleet: FleetView) -> Check | None:
    """`anti_affinity.same_service` (a replica): never a node that holds another replica
    of its service, bound or placed earlier in the cycle (a check per node: the cycle's
    placements change the answer). The replica-spread score only prefers apart."""
    siblings = ask.siblings
    if not ask.task.same_service_apart or not siblings:
        return None
    nodes = fleet.nodes
    return lambda position: "same_service" if siblings.get(nodes[position].id) else None


def model_pinned(ask: Ask, fleet: FleetView) -> Verdicts | None:
    """A replica whose model is pinned to nodes (Model.nodes) runs only on those; an
    unpinned model's replica may go anywhere (the model-cache score prefers the nodes
    that hold it)."""
    service = ask.task.replica_of
    if service is None:
        return None
    return fleet.verdicts(
        ("model_pinned", service), lambda node: "model_pinned" if node.model_pinned_away(service) else None
    )


def under_load(ask: Ask, fleet: FleetView) -> Verdicts:
    """Below the node's CPU and memory thresholds."""
    settings = fleet.settings
    return fleet.verdicts("load", lambda node: "load" if overloaded(node, settings) else None)


def inference_cap(ask: Ask, fleet: FleetView) -> Check | None:
    """An inference replica: the node runs fewer than the cap's inference replicas
    (settings.inference_cap, 0: no cap), counting those this cycle placed there. Other
    tasks never meet the cap."""
    cap = fleet.settings.inference_cap
    if ask.task.kind != TaskKind.INFERENCE or cap <= 0:
        return None
    count = fleet.inference_replicas
    return lambda position: "inference_cap" if count(position) >= cap else None


def host_port(ask: Ask, fleet: FleetView) -> Check | None:
    """An inference task needs a free host port on the node."""
    if ask.task.kind != TaskKind.INFERENCE:
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
    runtime_mode,
    node_affinity,
    label_anti_affinity,
    model_pinned,
    under_load,
    same_service,
    inference_cap,
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
            "runtime",
            "affinity",
            "anti_affinity",
            "same_service",
            "model_pinned",
            "inference_cap",
        )
    )
}
# The filters that answer from what the node is (its exec_mode, its labels), whatever its
# cards: a node they remove could never take the task, however much is freed on it (the
# groups' reach counts with them; explain says why in words).
NODE_CONSTRAINTS: tuple[Filter, ...] = (runtime_mode, node_affinity, label_anti_affinity, model_pinned)
CONSTRAINT_REASONS = frozenset({"runtime", "affinity", "anti_affinity", "same_service"})


def explained(removed: dict[str, int]) -> dict[str, int]:
    return {reason: removed[reason] for reason in sorted(removed, key=lambda r: REASON_ORDER.get(r, len(REASON_ORDER)))}


def model_words(removed: Mapping[str, int], cap: int) -> list[str]:
    """For the explanation only: in words, how the model's pinning and the inference
    cap (`cap` replicas a node) kept the nodes counted in `removed` off."""
    words = []
    if count := removed.get("model_pinned"):
        subject = "1 node is" if count == 1 else f"{count} nodes are"
        words.append(f"model pinned: {subject} not among the nodes its model is pinned to")
    if count := removed.get("inference_cap"):
        subject = "1 node already runs" if count == 1 else f"{count} nodes already run"
        words.append(
            f"inference cap: {subject} {cap} inference replica{'s' if cap != 1 else ''}, the most a node may "
            "(HETEROFLOW_INFERENCE_CONTAINERS_PER_NODE)"
        )
    return words
