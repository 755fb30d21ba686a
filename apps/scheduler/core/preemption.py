"""Preemption planning: after a failed placement, the node where evicting the fewest
lower-priority preemptible tasks makes room (on the same chain as placement)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from apps.scheduler.core.filters import Ask, Chain
from apps.scheduler.core.fleet import FleetView
from apps.scheduler.core.snapshot import GpuSnap, NodeSnap, PluginSettings, TaskReq
from apps.tasks.choices import TaskKind
from apps.tasks.choices import TaskStatus as S

# --- preemption -------------------------------------------------------------------------

PREEMPT_STAGES = ("disabled", "scheduled", "running")
# The statuses a victim may be in, per preempt_stage: "running" (the default) takes only
# running tasks; "scheduled" also tasks bound but not yet started.
VICTIM_STATUSES = {
    "disabled": frozenset(),
    "scheduled": frozenset({S.SCHEDULED, S.STARTING, S.RUNNING}),
    "running": frozenset({S.RUNNING}),
}
PREEMPTIBLE_KINDS = frozenset({TaskKind.JOB})  # training and inference are never victims
FREEING = S.PREEMPTING


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


def without_tasks(node: NodeSnap, gone: set[int]) -> NodeSnap:
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


@dataclass(frozen=True)
class BindFound:
    """A node as bind found it under its lock (apps.scheduler.bind.LiveCards), for the
    decisions there it refused: whether the node still takes work (`alive`), its cards
    that may take a placement (`usable`, by index) and the ledger's holders on its cards
    (index -> (task id, tenant, memory MB or None for the whole card))."""

    alive: bool
    usable: frozenset[int]
    holders: Mapping[int, Sequence[tuple[int, int | None, int | None]]]


def as_bind_found(node: NodeSnap, found: BindFound, refused: set[int]) -> NodeSnap:
    """The snapshot's node brought to what bind found (a copy, for preemption planning
    after a decision there was refused because the node changed): out of service when it
    takes no more work; a card no longer usable cordoned (it takes no placement); each
    card's holders those of the snapshot less the refused decisions (`refused`, task ids:
    the cycle put them there, bind did not), plus the ledger's it did not know (whoever
    took the card meanwhile)."""
    if not found.alive:
        return replace(node, executable=False)
    cards = []
    for gpu in node.gpus:
        kept = [holder for holder in gpu.holders if holder[0] not in refused]
        known = {holder[0] for holder in kept}
        kept += [holder for holder in found.holders.get(gpu.index, ()) if holder[0] not in known]
        undone = sum(memory or 0 for task_id, _, memory in gpu.holders if task_id in refused)
        cards.append(
            replace(
                gpu,
                holders=kept,
                placed_mb=max(gpu.placed_mb - undone, 0),
                cordoned=gpu.cordoned or gpu.index not in found.usable,
            )
        )
    return replace(node, gpus=cards)


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
    siblings: Mapping[str, int] | None = None,
    reclaim: frozenset[int] | None = None,
) -> PreemptionPlan | None:
    """After a failed placement: the node where evicting the fewest lower-priority
    preemptible tasks makes room. Per node, victims are taken in the order priority
    ascending, newest first, id, and only the shortest prefix that makes the task fit;
    across nodes the fewest victims win, then the smaller priority sum, then node id.
    Cards already being freed (tasks in preempting, or victims chosen this cycle for a
    task ahead in the queue: `taken`) count first and cost nothing: if they are enough,
    the plan has no victims and the task waits for them. None: evicting every candidate
    would not be enough anywhere, so nobody is evicted. `siblings`: a replica's, as
    placement had them (its service's replicas by node), so it is never planned beside
    one it must stay apart from. `reclaim`: a queue's reclaim (core.queues.reclaim_order):
    the victims are only these tasks, whatever their priority and kind, and the preempt
    plugin's stage does not apply."""
    if reclaim is None and (
        task.kind == TaskKind.TRAINING
        or settings.preempt_stage not in VICTIM_STATUSES
        or settings.preempt_stage == "disabled"
    ):
        return None
    occupied = [node for node in nodes if by_node.get(node.id)]
    # the chain, on each node as it would be without the tasks `gone`
    fleet = FleetView(occupied, settings, may_share, scores=False)
    chain = Chain.of(Ask.of(task, settings, siblings), fleet)

    def fits_without(position: int, gone: set[int]) -> bool:
        fleet.nodes[position] = without_tasks(occupied[position], gone)
        fleet.changed(position)
        return chain.rejection(position) is None

    best: tuple | None = None
    for position, node in enumerate(occupied):
        here = by_node[node.id]
        freeing = {o.id for o in here if o.status == FREEING or o.id in taken}
        candidates = sorted(
            (
                o
                for o in here
                if o.id not in freeing
                and (o.id in reclaim if reclaim is not None else may_preempt(task, o, settings.preempt_stage))
            ),
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
