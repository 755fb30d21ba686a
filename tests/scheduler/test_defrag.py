"""Defragmentation advice (apps.scheduler.core.defrag, and a waiting gang's explain for
operators): the fewest moves of preemptible tasks after which the gang fits, each checked
by the real placement; no plan when it fits already, when the moved tasks have nowhere to
go, or past the bound on moves."""

import pytest

from apps.scheduler.core import PluginSettings, place_queue
from apps.scheduler.core.defrag import Move, plan_defrag
from apps.scheduler.core.forecast import copy_nodes
from apps.scheduler.core.preemption import without_tasks
from apps.scheduler.models import GpuAllocation
from tests.factories import make_group, make_node, make_task
from tests.headers import bearer
from tests.scheduler.snapshots import SAME_TENANT_ONLY, group, node, task

SETTINGS = PluginSettings()


def holding(one, task_id, cards):
    for index in cards:
        one.gpus[index].holders.append((task_id, 1, None))
    return one


def fleet():
    """Four nodes of 8 cards, each half held: A and B (movable) on n0 and n1, C and D (not) on n2 and n3."""
    return [
        holding(node("n0"), 1, range(4)),
        holding(node("n1"), 2, range(4)),
        holding(node("n2"), 3, range(4)),
        holding(node("n3"), 4, range(4)),
    ]


MOVABLE = {1: task(id=1, gpus=4), 2: task(id=2, gpus=4)}


def test_two_moves_free_two_whole_nodes_for_a_gang_of_two_eights():
    nodes = fleet()
    gang = group(workers=2, gpus=8)
    plan = plan_defrag(gang, nodes, SETTINGS, SAME_TENANT_ONLY, MOVABLE)
    assert plan is not None
    assert {(m.task_id, m.from_node) for m in plan.moves} == {(1, "n0"), (2, "n1")}
    assert {m.to_node for m in plan.moves} == {"n2", "n3"} and all(m.cards == (0, 1, 2, 3) for m in plan.moves)
    assert plan.frees == {"n0": 4, "n1": 4}
    assert plan.words().startswith("move task 1 from n0 to ")
    # applied to the snapshot, the real placement then places the gang on the freed nodes
    after = [without_tasks(n, {1, 2}) for n in copy_nodes(nodes)]
    moved = {m.task_id: m.to_node for m in plan.moves}
    for one in after:
        for task_id, target in moved.items():
            if one.id == target:
                holding(one, task_id, [g.index for g in one.gpus if not g.holders][:4])
    placed = place_queue([gang], after, SETTINGS, SAME_TENANT_ONLY)
    assert {d.node_id for g in placed.groups for d in g.decisions} == {"n0", "n1"}
    assert nodes[0].gpus[0].holders == [(1, 1, None)]  # the caller's snapshot is untouched


def test_no_plan_when_it_fits_already_or_the_moved_tasks_have_nowhere_to_go_or_too_many_moves():
    assert plan_defrag(group(workers=1, gpus=4), fleet(), SETTINGS, SAME_TENANT_ONLY, MOVABLE) is None  # fits now
    crowded = fleet()
    holding(crowded[2], 3, range(4, 8))  # n2 and n3 full: A and B cannot go anywhere
    holding(crowded[3], 4, range(4, 8))
    assert plan_defrag(group(workers=2, gpus=8), crowded, SETTINGS, SAME_TENANT_ONLY, MOVABLE) is None
    assert plan_defrag(group(workers=2, gpus=8), fleet(), SETTINGS, SAME_TENANT_ONLY, MOVABLE, max_moves=1) is None
    assert plan_defrag(group(workers=2, gpus=8), fleet(), SETTINGS, SAME_TENANT_ONLY, {}) is None  # none movable


def test_the_fewest_moves_win():
    nodes = [holding(node("n0"), 1, range(2)), holding(holding(node("n1"), 2, range(2)), 5, range(2, 4)), node("n2", 4)]
    movable = {1: task(id=1, gpus=2), 2: task(id=2, gpus=2), 5: task(id=5, gpus=2)}
    plan = plan_defrag(group(workers=1, gpus=8), nodes, SETTINGS, SAME_TENANT_ONLY, movable)
    assert plan is not None and [m.task_id for m in plan.moves] == [1]  # n0 needs one move, n1 two
    assert plan.moves[0] == Move(1, "n0", "n2", (0, 1))


@pytest.mark.django_db
def test_a_waiting_gangs_explain_gives_operators_the_plan(api, world):
    acme = world.tenants["acme"]
    for number in range(4):
        make_node(f"n{number}", gpus=8)
    for number in range(4):
        holder = make_task(
            acme, name=f"h{number}", status="running", node_id=f"n{number}", gpu_required=4, preemptible=number < 2
        )
        for card in range(4):
            GpuAllocation.objects.create(task=holder, node_id=f"n{number}", gpu_index=card, tenant=acme)
    gang = make_group(acme, workers=2, gpus=8)
    operator = api.get(f"/api/v1/task-groups/{gang.pk}/explain", **bearer(world.operator_key)).json()
    advice = [row for row in operator["suggestions"] if row["starts"] == "after moves"]
    assert len(advice) == 1 and advice[0]["change"] == {}
    assert advice[0]["why"].startswith("operators: move task ")
    assert {move["from_node"] for move in advice[0]["moves"]} == {"n0", "n1"}
    member = api.get(f"/api/v1/task-groups/{gang.pk}/explain", **bearer(world.keys["acme-member"])).json()
    assert all(row["starts"] != "after moves" for row in member["suggestions"])
