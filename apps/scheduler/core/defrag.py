"""Defragmentation advice (docs/predictions.md#defragmentation-advice): when a waiting gang
would fit if a few preemptible tasks moved, the smallest move set found: which tasks,
from which node to which, and the cards that frees. Pure: the real placement decides
both that the moved tasks fit elsewhere and that the gang then fits; this module only
chooses what to try.

The choice is greedy. A node of the gang's type can take a worker once its free cards
and the cards of the movable tasks on it add up to the worker's cards; it costs the fewest
of those tasks that do so, largest first. The nodes that cost least (then hold most free
cards) are taken until every worker has a place. The plan stands only if the real
placement puts every moved task on a node outside those targets, and then the whole
gang, on the fleet as the moves leave it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from apps.scheduler.core.forecast import copy_nodes
from apps.scheduler.core.groups import GroupReq
from apps.scheduler.core.placement import place_queue
from apps.scheduler.core.preemption import without_tasks
from apps.scheduler.core.snapshot import NodeSnap, PluginSettings, TaskReq

MAX_MOVES = 8


@dataclass(frozen=True)
class Move:
    task_id: int
    from_node: str
    to_node: str
    cards: tuple[int, ...]  # the cards it frees on from_node


@dataclass(frozen=True)
class DefragPlan:
    group_id: int
    moves: tuple[Move, ...]
    frees: dict[str, int] = field(default_factory=dict)  # node -> cards the moves free there

    def words(self) -> str:
        moves = "; ".join(f"task {m.task_id} from {m.from_node} to {m.to_node}" for m in self.moves)
        freed = ", ".join(f"{count} on {node}" for node, count in sorted(self.frees.items()))
        return f"move {moves}: frees {freed} cards, and the gang fits"


def plan_defrag(
    gang: GroupReq,
    nodes: Sequence[NodeSnap],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    movable: Mapping[int, TaskReq],
    max_moves: int = MAX_MOVES,
) -> DefragPlan | None:
    """The fewest moves of `movable` tasks (running whole-card tasks that may be stopped
    and requeued, by id) after which `gang` fits; None when it fits already, or no plan
    within `max_moves` does."""
    if _fits(gang, copy_nodes(nodes), settings, may_share):
        return None
    vendor = gang.gpu_type.lower()
    need = gang.gpus_per_worker
    options = []  # (moves needed, -free cards, node, the movers, slots)
    for node in nodes:
        if not node.gpus or any(gpu.vendor.lower() != vendor for gpu in node.gpus):
            continue
        free = sum(1 for gpu in node.gpus if gpu.placeable and not gpu.holders)
        holders: dict[int, list[int]] = {}
        for gpu in node.gpus:
            for task_id, _, memory in gpu.holders:
                if memory is None and task_id in movable:
                    holders.setdefault(task_id, []).append(gpu.index)
        movers: list[tuple[int, tuple[int, ...]]] = []
        freed = free
        for task_id, cards in sorted(holders.items(), key=lambda item: (-len(item[1]), item[0])):
            if freed >= need:
                break
            movers.append((task_id, tuple(cards)))
            freed += len(cards)
        if freed >= need:
            options.append((len(movers), -free, node.id, movers, freed // need))
    options.sort(key=lambda option: option[:3])
    targets: list[str] = []
    chosen: list[tuple[str, int, tuple[int, ...]]] = []  # (node, task, cards)
    slots = 0
    for _, _, node_id, movers, node_slots in options:
        if slots >= gang.world_size:
            break
        targets.append(node_id)
        chosen += [(node_id, task_id, cards) for task_id, cards in movers]
        slots += node_slots
    if slots < gang.world_size or not chosen or len(chosen) > max_moves:
        return None
    moving = {task_id for _, task_id, _ in chosen}
    fleet = [without_tasks(node, moving) if node.id in targets else node for node in copy_nodes(nodes)]
    elsewhere = [node for node in fleet if node.id not in targets]
    placed = place_queue([movable[task_id] for _, task_id, _ in chosen], elsewhere, settings, may_share)
    if len(placed.decisions) != len(chosen):
        return None
    if not _fits(gang, fleet, settings, may_share):
        return None
    landed = {decision.task_id: decision.node_id for decision in placed.decisions}
    frees: dict[str, int] = {}
    for node_id, _, cards in chosen:
        frees[node_id] = frees.get(node_id, 0) + len(cards)
    return DefragPlan(
        gang.id,
        tuple(Move(task_id, node_id, landed[task_id], cards) for node_id, task_id, cards in chosen),
        frees,
    )


def _fits(gang: GroupReq, fleet: list[NodeSnap], settings: PluginSettings, may_share) -> bool:
    return bool(place_queue([gang], fleet, settings, may_share).groups)
