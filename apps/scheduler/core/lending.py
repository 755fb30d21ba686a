"""Training borrows idle inference cards: which replicas an idle service may lend, and,
for a training task that did not fit, the node where the fewest lent replicas make room
(on the same chain as placement). Pure: the services come in as data (LendingService,
read by the inference app's offer), the plan goes out; the inference app applies it.

A service lends its highest ranks first (what a scale-down stops), so lending the replica
of rank r lends every rank above it too. It may lend down to the larger of its
`min_replicas` and what its autoscaler's latest reading needs (a scale-down), or every
replica when that reading needs none (it is put to sleep); never more than the
operator's cap at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from apps.scheduler.core.filters import Ask, Chain
from apps.scheduler.core.fleet import FleetView
from apps.scheduler.core.groups import GroupDecision, GroupReq, place_group
from apps.scheduler.core.preemption import without_tasks
from apps.scheduler.core.snapshot import NodeSnap, PluginSettings, TaskReq
from apps.tasks.choices import GroupKind, TaskKind

LENDING_STATE = "running"  # only a running service lends (apps.inference.choices.ServiceStatus)


@dataclass(frozen=True)
class LendingService:
    """An inference service as lending sees it (the snapshot's data).

    `need`: the replicas its autoscaler's latest reading asks for (None: no reading, so
    it is not known to be idle and lends nothing); `settled`: every replica below its
    count runs, none is starting or ending (a service mid-change lends nothing);
    `on_loan`: it has lent already (one loan at a time); `slots`: its replicas holding
    cards, (task id, node id), highest rank first."""

    id: int
    tenant_id: int
    lendable: bool
    state: str
    replicas: int
    min_replicas: int
    need: int | None
    settled: bool
    on_loan: bool = False
    slots: tuple[tuple[int, str], ...] = ()
    name: str = ""


def lendable_counts(service: LendingService, cap: int) -> tuple[int, ...]:
    """How many replicas the service may lend now, ascending (empty: none): 1 up to its
    surplus over max(min_replicas, need) (scaled down), and all of them when its reading
    needs none (put to sleep); each at most `cap` (0: lending is off)."""
    if (
        cap <= 0
        or not service.lendable
        or service.state != LENDING_STATE
        or service.need is None
        or not service.settled
        or service.on_loan
    ):
        return ()
    surplus = service.replicas - max(service.need, service.min_replicas)
    counts = list(range(1, min(surplus, cap) + 1))
    if service.need == 0 and 0 < service.replicas <= cap and service.replicas not in counts:
        counts.append(service.replicas)
    return tuple(counts)


@dataclass
class LoanPlan:
    """A training task's loan: the node it goes to once the replicas have stopped, and
    per service the replicas it lends (its highest ranks), scaled down or put to sleep
    (`sleeps`: lends every replica)."""

    task_id: int
    node_id: str
    lent: dict[int, int]  # service id -> replicas lent
    replicas: list[int]  # the replica tasks that stop (every lent rank, on any node)
    sleeps: frozenset[int] = field(default_factory=frozenset)  # the services lending all their replicas
    counts: dict[int, int] = field(default_factory=dict)  # service id -> its count as offered (lent from)
    group_id: int | None = None  # a task group's loan: task_id is its rank 0, node_id its master's node
    nodes: list[str] = field(default_factory=list)  # a group's: every node its workers would use

    def as_reason(self, names: dict[int, str] | None = None) -> dict:
        names = names or {}
        reason = {"nodes": self.nodes} if self.group_id is not None else {}
        return reason | {
            "node_id": self.node_id,
            "services": [
                {"service_id": pk, "name": names.get(pk, ""), "replicas": count, "sleeps": pk in self.sleeps}
                for pk, count in sorted(self.lent.items())
            ],
            "replicas": sorted(self.replicas),
        }


def borrows(task: TaskReq | GroupReq) -> bool:
    """Whether the task may borrow: a training task that asks for whole cards, or a
    training task group (its workers always do)."""
    if isinstance(task, GroupReq):
        return task.kind == GroupKind.TRAINING
    return task.kind == TaskKind.TRAINING and task.gpu_required > 0


def _offers(
    tenant_id: int, services: Sequence[LendingService], may_share, cap: int, taken
) -> dict[int, tuple[LendingService, tuple[int, ...]]]:
    """service id -> (the service, what it may lend) for each service that may lend to
    the tenant now."""
    offers = {}
    for service in services:
        if service.id in taken:
            continue
        counts = lendable_counts(service, cap)
        if counts and may_share(tenant_id, service.tenant_id):
            offers[service.id] = (service, counts)
    return offers


def plan_loan(
    task: TaskReq,
    nodes: Sequence[NodeSnap],
    services: Sequence[LendingService],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    cap: int,
    taken: frozenset[int] | set[int] = frozenset(),
) -> LoanPlan | None:
    """For a training task that did not fit: the node where the fewest lent replicas
    make it fit, or None. Only services of its tenant or its tenant group lend to it
    (may_share, fail-closed), each as lendable_counts allows; `taken`: services that
    lent to a task ahead in this cycle. Per node, the replica that lends the fewest more
    is added first (ties: service id), until the task fits; across nodes the fewest
    replicas lent win, then node id. None when lending every candidate would not be
    enough anywhere (nobody lends)."""
    if not borrows(task):
        return None
    offers = _offers(task.tenant_id, services, may_share, cap, taken)
    if not offers:
        return None
    # node id -> [(service id, position in its lending order)]
    on_node: dict[str, list[tuple[int, int]]] = {}
    for pk, (service, counts) in offers.items():
        for position, (_, node_id) in enumerate(service.slots):
            if position < counts[-1]:
                on_node.setdefault(node_id, []).append((pk, position))
    occupied = [node for node in nodes if node.id in on_node]
    if not occupied:
        return None
    fleet = FleetView(occupied, settings, may_share, scores=False)
    chain = Chain.of(Ask.of(task, settings), fleet)

    def lent_ids(lent: dict[int, int]) -> set[int]:
        return {offers[pk][0].slots[i][0] for pk, count in lent.items() for i in range(count)}

    def fits_without(position: int, lent: dict[int, int]) -> bool:
        fleet.nodes[position] = without_tasks(occupied[position], lent_ids(lent))
        fleet.changed(position)
        return chain.rejection(position) is None

    best: tuple | None = None
    for position, node in enumerate(occupied):
        if chain.gate[position] is not None:
            continue  # removed for what lending does not change (unavailable, another tenant's node, loaded)
        lent: dict[int, int] = {}
        found = False
        while not found:
            step = _cheapest_step(on_node[node.id], lent, offers)
            if step is None:
                break
            pk, count = step
            lent[pk] = count
            if best is not None and sum(lent.values()) > best[0][0]:
                break  # already more than a plan elsewhere
            found = fits_without(position, lent)
        if not found:
            continue
        rank = (sum(lent.values()), node.id)
        if best is None or rank < best[0]:
            best = (rank, node.id, dict(lent))
    if best is None:
        return None
    _, node_id, lent = best
    sleeps = frozenset(pk for pk, count in lent.items() if count == offers[pk][0].replicas)
    counts = {pk: offers[pk][0].replicas for pk in lent}
    return LoanPlan(task.id, node_id, lent, sorted(lent_ids(lent)), sleeps, counts)


def _cheapest_step(
    here: list[tuple[int, int]],
    lent: dict[int, int],
    offers: dict[int, tuple[LendingService, tuple[int, ...]]],
    node_of: Callable[[int, int], str] | None = None,
) -> tuple[int, int] | None:
    """The next replica to free of those `here` ((service id, position in its lending
    order)): (service id, the count its service then lends), the one adding the fewest
    lent replicas (ties: its node by `node_of` when given, then service id); None when
    none is left."""
    best = None
    for pk, position in here:
        already = lent.get(pk, 0)
        if position < already:
            continue  # freed already
        counts = offers[pk][1]
        count = next((c for c in counts if c > position), None)
        if count is None:
            continue
        key = (count - already, node_of(pk, position) if node_of else "", pk)
        if best is None or key < best[0]:
            best = (key, (pk, count))
    return best[1] if best else None


def plan_group_loan(
    group: GroupReq,
    nodes: Sequence[NodeSnap],
    services: Sequence[LendingService],
    settings: PluginSettings,
    may_share: Callable[[int, int], bool],
    cap: int,
    taken: frozenset[int] | set[int] = frozenset(),
) -> LoanPlan | None:
    """For a training task group that did not fit: the fewest lent replicas, on any nodes,
    with which every worker is placed (place_group, on the snapshot as it would be
    without them), or None. Greedy: the replica that lends the fewest more of its
    service is added first (ties: its node id, then service id), until the whole group
    fits; the lenders are as for a single task (plan_loan). The plan's node is rank 0's,
    `nodes` every node its workers would use."""
    if not borrows(group):
        return None
    offers = _offers(group.tenant_id, services, may_share, cap, taken)
    if not offers:
        return None
    here = [(pk, position) for pk, (service, counts) in offers.items() for position in range(counts[-1])]
    lent: dict[int, int] = {}
    while True:
        step = _cheapest_step(here, lent, offers, node_of=lambda pk, position: offers[pk][0].slots[position][1])
        if step is None:
            return None
        pk, count = step
        lent[pk] = count
        gone = {offers[s][0].slots[i][0] for s, c in lent.items() for i in range(c)}
        outcome = place_group(group, FleetView(_copied(nodes, gone), settings, may_share, scores=False))
        if isinstance(outcome, GroupDecision):
            break
    sleeps = frozenset(s for s, c in lent.items() if c == offers[s][0].replicas)
    counts = {s: offers[s][0].replicas for s in lent}
    used = sorted({decision.node_id for decision in outcome.decisions})
    master = outcome.decisions[0].node_id
    return LoanPlan(group.members[0], master, lent, sorted(gone), sleeps, counts, group.id, used)


def _copied(nodes: Sequence[NodeSnap], gone: set[int]) -> list[NodeSnap]:
    """The nodes without the tasks `gone`, each card a copy (place_group writes its
    decisions onto the cards it is given: the cycle's snapshot must not see them)."""
    copies = []
    for node in nodes:
        freed = without_tasks(node, gone)
        copies.append(replace(freed, gpus=[replace(gpu, holders=list(gpu.holders)) for gpu in freed.gpus]))
    return copies
