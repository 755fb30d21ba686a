"""No starvation, in the pure core: a task group that reserves holds the cards it waits
for against the smaller work behind it in the queue, until it can be placed whole;
higher-priority work still goes first; nothing is held once it binds or leaves the queue."""

from apps.scheduler.core import GroupDecision, PluginSettings, Reservation, place_queue
from tests.scheduler.snapshots import SAME_TENANT_ONLY, group, node, task


def cycle(queue, nodes, reserving=None):
    placement = place_queue(queue, nodes, PluginSettings(), SAME_TENANT_ONLY, reserving=reserving)
    # the snapshot is read afresh every cycle: what was held lives only in this one
    for n in nodes:
        for gpu in n.gpus:
            gpu.holders = [holder for holder in gpu.holders if holder[0] > 0]
    return placement


def hold_everything(nodes, first_id=1):
    """Every card held by a 1-card task, task ids from first_id in node order; returns
    them oldest first, started card by card across the nodes (card 0 of every node,
    then card 1…), so that they end spread over the fleet."""
    running = []
    for n in nodes:
        for gpu in n.gpus:
            gpu.holders.append((first_id, 1, None))
            running.append((gpu.index, n.id, first_id))
            first_id += 1
    return [task_id for _, _, task_id in sorted(running)]


def finish(nodes, task_ids):
    for n in nodes:
        for gpu in n.gpus:
            gpu.holders = [holder for holder in gpu.holders if holder[0] not in task_ids]


def run_stream(reserve: bool, rounds: int = 40):
    """Six nodes of 8 cards, all busy with small tasks of the group's priority; each round
    the two oldest end and two new ones arrive (younger than the group: behind it in the
    queue). Returns the round the 4 × 8 group was placed in (None: never), and every
    round's placement."""
    nodes = [node(f"n{i}") for i in range(6)]
    running = hold_everything(nodes)
    gang = group(id=7, workers=4, gpus=8, priority=50)
    waiting: list[int] = []
    next_id = 1000
    previous: tuple[str, ...] = ()
    history = []
    for round_ in range(rounds):
        done, running = running[:2], running[2:]
        finish(nodes, set(done))
        waiting += [next_id, next_id + 1]
        next_id += 2
        queue = [gang] + [task(id=t, gpus=1, priority=50) for t in waiting]
        placement = cycle(queue, nodes, {gang.id: previous} if reserve else None)
        history.append(placement)
        if placement.groups:
            return round_, history
        [failure] = placement.group_failures
        if failure.reservation is not None:
            previous = tuple(failure.reservation.wanted)
        placed = {d.task_id for d in placement.decisions}
        running += [t for t in waiting if t in placed]
        waiting = [t for t in waiting if t not in placed]
    return None, history


def test_without_a_reservation_a_stream_of_small_tasks_starves_the_group():
    placed_in, _ = run_stream(reserve=False)
    assert placed_in is None


def test_a_reserving_group_against_a_stream_of_small_tasks_is_eventually_placed():
    placed_in, history = run_stream(reserve=True)
    # the group needs 4 whole nodes; the oldest tasks end card by card across the six
    # nodes, two a round: the last card of n2 and n3 (its target with n0 and n1) frees up
    # in round 22, and nothing that freed there meanwhile was taken
    assert placed_in == 22
    # meanwhile small tasks still ran elsewhere: the reservation holds only what it needs
    assert any(history[r].decisions for r in range(placed_in))
    for placement in history[:placed_in]:
        [failure] = placement.group_failures
        assert set(failure.reservation.wanted) == {"n0", "n1", "n2", "n3"}
        assert all(d.node_id in ("n4", "n5") for d in placement.decisions)
    # and the tasks kept off say why
    blocked = [f for f in history[3].failures]
    assert blocked and all(f.removed.get("reserved") for f in blocked)


def test_the_reservation_holds_what_frees_up_and_explains_itself():
    nodes = [node("n0", n=4), node("n1", n=4), node("n2", n=4)]
    hold_everything(nodes)
    finish(nodes, {1, 2, 5})  # n0 cards 0, 1 and n1 card 0 are free
    gang = group(id=3, workers=2, gpus=4)
    placement = cycle([gang, task(id=100, gpus=1), task(id=101, gpus=2)], nodes, {gang.id: ()})
    [failure] = placement.group_failures
    held = failure.reservation
    assert isinstance(held, Reservation)
    # the freest nodes first: n0 (2 free), then n1 (1 free); n2 has nothing free
    assert held.wanted == {"n0": 4, "n1": 4} and held.held == {"n0": [0, 1], "n1": [0]}
    assert (held.nodes_held, held.workers_held) == (0, 0)
    assert placement.decisions == []
    assert [f.removed for f in placement.failures] == [{"reserved": 2, "capacity": 1}, {"reserved": 1, "capacity": 2}]
    reason = failure.as_reason()
    assert reason["code"] == "Reserved" and reason["cause"] == "InsufficientResources"
    assert reason["message"] == "reserved, 0 of 2 nodes held"
    assert reason["reservation"]["nodes"] == [
        {"node_id": "n0", "wanted": 4, "held": [0, 1]},
        {"node_id": "n1", "wanted": 4, "held": [0]},
    ]
    # next cycle: n0 is all free, the target is kept (n2 freeing up more does not move it)
    finish(nodes, {3, 4, 9, 10, 11})
    placement = cycle([gang, task(id=100, gpus=1)], nodes, {gang.id: ("n0", "n1")})
    held = placement.group_failures[0].reservation
    assert held.wanted == {"n0": 4, "n1": 4} and held.held == {"n0": [0, 1, 2, 3], "n1": [0]}
    assert placement.group_failures[0].as_reason()["message"] == "reserved, 1 of 2 nodes held"
    assert [d.node_id for d in placement.decisions] == ["n2"]  # off the target, a small task still runs


def test_higher_priority_work_still_goes_first():
    nodes = [node("n0", n=4), node("n1", n=4)]
    hold_everything(nodes)
    finish(nodes, {1, 5})  # one card free on each node
    gang = group(id=3, workers=2, gpus=4, priority=50)
    queue = [task(id=100, gpus=1, priority=90), gang, task(id=101, gpus=1, priority=50), task(id=102, priority=10)]
    placement = cycle(queue, nodes, {gang.id: ()})
    assert [d.task_id for d in placement.decisions] == [100]
    held = placement.group_failures[0].reservation
    assert sum(len(cards) for cards in held.held.values()) == 1  # what the high one left
    assert [f.task_id for f in placement.failures] == [101, 102]
    # a higher-priority group behind nothing is not held back either
    rival = group(id=4, workers=1, gpus=1, priority=80, first_member=2000)
    finish(nodes, {2})
    placement = cycle([rival, gang], nodes, {gang.id: ("n0", "n1")})
    assert [g.group_id for g in placement.groups] == [4]


def test_nothing_is_held_for_a_group_the_fleet_could_never_take_nor_once_it_binds():
    nodes = [node("n0", n=4), node("n1", n=4)]
    gang = group(id=3, workers=3, gpus=4)  # 3 nodes' worth on a fleet of 2
    placement = cycle([gang, task(id=100, gpus=4)], nodes, {gang.id: ()})
    [failure] = placement.group_failures
    assert failure.reservation is None and failure.reach == 2
    assert failure.as_reason()["workers"] == {"placeable": 2, "needed": 3, "reach": 2}
    assert [d.task_id for d in placement.decisions] == [100]
    # a reserving group that fits is placed, and holds nothing
    finish(nodes, {100})
    fits = group(id=5, workers=2, gpus=4, first_member=3000)
    placement = cycle([fits, task(id=101, gpus=1)], nodes, {fits.id: ("n0", "n1")})
    assert isinstance(placement.groups[0], GroupDecision) and placement.group_failures == []
    assert placement.failures[0].removed == {"capacity": 2}  # taken by the group, not "reserved"
    # and a group out of the queue (stopped) holds nothing: the small task gets the node
    nodes = [node("n0", n=4)]
    placement = cycle([task(id=102, gpus=4)], nodes, {fits.id: ("n0",)})
    assert [d.task_id for d in placement.decisions] == [102]


def test_two_reserving_groups_do_not_hold_the_same_cards():
    nodes = [node("n0", n=4), node("n1", n=4), node("n2", n=4)]
    hold_everything(nodes)
    finish(nodes, {1, 2, 5, 9})
    high = group(id=3, workers=2, gpus=4, priority=80)
    low = group(id=4, workers=2, gpus=4, priority=50, first_member=2000)
    placement = cycle([high, low], nodes, {high.id: (), low.id: ()})
    first, second = (f.reservation for f in placement.group_failures)
    held_first = {(n, i) for n, cards in first.held.items() for i in cards}
    held_second = {(n, i) for n, cards in second.held.items() for i in cards}
    assert held_first == {("n0", 0), ("n0", 1), ("n1", 0)} and held_second == {("n2", 0)}
