"""No starvation and the group window, through the scheduler's cycle on the database: the
head of a priority reserves after the wait, holds what frees up, binds, and its report
goes; a stopped group holds nothing; a group behind a window's worth of stuck ones, or
behind higher-priority ones, is still decided."""

from datetime import datetime, timedelta

import pytest

from apps.core.clock import utcnow
from apps.nodes.models import Node
from apps.scheduler import cycle
from apps.scheduler.services import GROUP_BATCH_SIZE, run_cycle
from apps.tasks.models import Task, TaskGroup
from apps.tasks.services import move_tasks, stop_tasks
from tests.factories import make_group, make_node, make_task, make_task_holding
from tests.scheduler.ledger import ledger_agrees

pytestmark = pytest.mark.django_db


def group_row(group) -> TaskGroup:
    return TaskGroup.objects.get(pk=group.pk)


def end(*tasks):
    """The tasks end as the agent and the user would end them: a running one completes,
    a scheduled one is cancelled (their cards go back)."""
    ids = [t.pk for t in tasks]
    assert len(move_tasks(ids, ["running"], "completed") + move_tasks(ids, ["scheduled"], "cancelled")) == len(ids)


def status(task) -> str:
    return Task.objects.get(pk=task.pk).status


def test_the_head_reserves_after_the_wait_holds_what_frees_up_and_binds(world, settings):
    settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS = 300
    acme = world.tenants["acme"]
    n0, n1 = make_node("n0", gpus=4), make_node("n1", gpus=4)
    r0, r1 = make_task_holding(n0, acme, "running", card=0), make_task_holding(n1, acme, "running", card=0)
    group = make_group(acme, workers=2, gpus=4)
    early = make_task(acme, gpu_required=1)  # younger than the group, the same priority

    # the group just became the head: it waits, holding nothing yet
    result = run_cycle()
    assert result.bound == [early.pk]
    report = group_row(group).reservation
    assert report["state"] == "waiting" and "nodes" not in report
    since = datetime.fromisoformat(report["head_since"])
    assert datetime.fromisoformat(report["reserves_after"]) - since == timedelta(seconds=300)
    assert group_row(group).schedule_reason["reservation"] == report

    # the next cycle keeps the time it became the head; five minutes on, it reserves
    run_cycle()
    assert group_row(group).reservation["head_since"] == report["head_since"]
    TaskGroup.objects.filter(pk=group.pk).update(
        reservation=report | {"head_since": (since - timedelta(seconds=301)).isoformat()}
    )
    late = [make_task(acme, gpu_required=1) for _ in range(2)]
    result = run_cycle()
    assert result.bound == []
    row = group_row(group)
    assert row.reservation["state"] == "holding"
    held = {entry["node_id"]: entry["held"] for entry in row.reservation["nodes"]}
    assert sum(map(len, held.values())) == 5  # every free card of the two nodes
    assert row.schedule_reason["code"] == "Reserved" and row.schedule_reason["cause"] == "InsufficientResources"
    assert row.schedule_reason["message"] == "reserved, 0 of 2 nodes held"
    member = Task.objects.filter(group=group).first().schedule_reason  # a line, and where the details are
    assert (member["message"], member["group"]) == ("reserved, 0 of 2 nodes held", group.pk)
    assert "reservation" not in member
    for small in late:
        reason = Task.objects.get(pk=small.pk).schedule_reason
        assert status(small) == "pending" and reason["removed_by"] == {"reserved": 2}

    # cards that free up are held too, until the group can be placed whole
    end(r1)
    run_cycle()
    assert group_row(group).schedule_reason["message"] == "reserved, 1 of 2 nodes held"
    assert [status(small) for small in late] == ["pending", "pending"]
    end(r0, early)
    result = run_cycle()
    assert result.groups_bound == [group.pk]
    row = group_row(group)
    assert (row.reservation, row.schedule_reason, row.status) == ({}, {}, "scheduled")
    assert [status(small) for small in late] == ["pending", "pending"]
    assert ledger_agrees()


def test_higher_priority_work_takes_a_held_card(world, settings):
    settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS = 0
    acme = world.tenants["acme"]
    n0 = make_node("n0", gpus=4)
    make_task_holding(n0, acme, "running", card=0)
    group = make_group(acme, workers=1, gpus=4, priority=50)
    low = make_task(acme, gpu_required=1, priority=50)
    run_cycle()
    assert status(low) == "pending" and group_row(group).reservation["state"] == "holding"
    high = make_task(acme, gpu_required=1, priority=90)
    result = run_cycle()
    assert result.bound == [high.pk] and status(low) == "pending"
    [entry] = group_row(group).reservation["nodes"]
    assert len(entry["held"]) == 2 and entry["wanted"] == 4


def test_a_stopped_group_holds_nothing_and_its_report_goes(world, settings):
    settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS = 0
    acme = world.tenants["acme"]
    n0 = make_node("n0", gpus=2)
    make_task_holding(n0, acme, "running", card=0)
    group = make_group(acme, workers=1, gpus=2)
    small = make_task(acme, gpu_required=1)
    run_cycle()
    assert status(small) == "pending" and group_row(group).reservation["state"] == "holding"
    stop_tasks(Task.objects.filter(group=group).values_list("pk", flat=True))
    result = run_cycle()
    assert result.bound == [small.pk]
    assert group_row(group).reservation == {}


def test_a_report_goes_even_when_the_queue_is_empty(world, settings):
    settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS = 0
    acme = world.tenants["acme"]
    n0 = make_node("n0", gpus=2)
    make_task_holding(n0, acme, "running", card=0)
    group = make_group(acme, workers=1, gpus=2)
    run_cycle()
    assert group_row(group).reservation["state"] == "holding"
    stop_tasks(Task.objects.filter(group=group).values_list("pk", flat=True))
    assert run_cycle().considered == 0
    assert group_row(group).reservation == {}


def test_only_the_head_of_a_priority_reserves_and_a_group_out_of_reach_is_never_the_head(world, settings):
    settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS = 0
    acme = world.tenants["acme"]
    n0 = make_node("n0", gpus=4)
    make_task_holding(n0, acme, "running", card=0)
    never = make_group(acme, workers=2, gpus=4)  # two nodes' worth on a fleet of one
    head = make_group(acme, workers=1, gpus=4)
    run_cycle()  # `never` is the first of the priority: nothing known about it yet
    assert group_row(never).schedule_reason["workers"]["reach"] == 1
    assert group_row(never).reservation["state"] == "waiting"  # nothing it could hold
    assert group_row(head).reservation == {}
    second = make_group(acme, workers=1, gpus=2)  # would fit in the three free cards
    run_cycle()
    assert group_row(never).reservation == {}
    assert group_row(head).reservation["state"] == "holding"
    assert group_row(second).reservation == {}
    assert group_row(second).schedule_reason["removed_by"] == {"reserved": 1}


def test_a_placeable_group_behind_more_than_a_window_of_stuck_ones_is_placed(world):
    acme = world.tenants["acme"]
    ascend = make_node("asc", gpus=8, vendor="ascend")
    for card in range(8):  # the type is in reach, but busy: the groups wait, they are not out of reach
        make_task_holding(ascend, acme, "running", card=card)
    stuck = [make_group(acme, workers=1, gpus=8, gpu_type="ascend") for _ in range(GROUP_BATCH_SIZE + 5)]
    make_node("nv", gpus=1)
    placeable = make_group(acme, workers=1, gpus=1)  # the youngest, the same priority
    first = run_cycle()
    assert first.groups_bound == [] and len(first.groups_failed) == GROUP_BATCH_SIZE
    assert placeable.pk not in first.groups_failed
    # the window carries on after where it ended (and wraps round): the group is decided
    second = run_cycle()
    assert second.groups_bound == [placeable.pk]
    assert set(first.groups_failed) | set(second.groups_failed) == {g.pk for g in stuck}
    # the head of the priority was in both windows
    assert stuck[0].pk in first.groups_failed and stuck[0].pk in second.groups_failed


def test_the_head_of_a_lower_priority_is_decided_behind_any_number_of_higher_ones(world):
    acme = world.tenants["acme"]
    make_node("nv", gpus=1)
    for _ in range(GROUP_BATCH_SIZE + 5):
        make_group(acme, workers=1, gpus=1, gpu_type="ascend", priority=80)  # no such card at all
    low = make_group(acme, workers=1, gpus=1, priority=10)
    assert run_cycle().groups_bound == [low.pk]


def test_the_time_at_the_head_is_measured_by_the_cycle_clock(world, settings, monkeypatch):
    settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS = 300
    acme = world.tenants["acme"]
    n0 = make_node("n0", gpus=2)
    make_task_holding(n0, acme, "running", card=0)
    group = make_group(acme, workers=1, gpus=2)
    start = utcnow()
    for seconds, reserving in ((0, False), (299, False), (300, True)):
        now = start + timedelta(seconds=seconds)
        monkeypatch.setattr(cycle, "utcnow", lambda now=now: now)
        Node.objects.filter(pk="n0").update(last_heartbeat_at=now)  # the node still beats meanwhile
        small = make_task(acme, gpu_required=1)
        run_cycle()
        assert status(small) == ("pending" if reserving else "scheduled"), seconds
        assert group_row(group).reservation["state"] == ("holding" if reserving else "waiting")
        if not reserving:
            end(small)


def test_declared_short_work_backfills_the_held_cards_and_the_rest_waits(world, settings):
    """Backfill through the cycle: the reservation is dated by the running work's expected
    ends (declared duration, else timeout, from its start); a task that declares it ends
    by then runs on a held card; one that would outlast it, or declares nothing, waits."""
    settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS = 0
    acme = world.tenants["acme"]
    n0, n1 = make_node("n0", gpus=4), make_node("n1", gpus=4)
    started = utcnow()
    r0, r1 = make_task_holding(n0, acme, "running", card=0), make_task_holding(n1, acme, "running", card=0)
    Task.objects.filter(pk=r0.pk).update(started_at=started, timeout_seconds=7200)
    Task.objects.filter(pk=r1.pk).update(started_at=started, timeout_seconds=7200, max_duration_seconds=600)
    group = make_group(acme, workers=2, gpus=4, priority=60)
    run_cycle()  # the head reserves from its first cycle (no wait asked)
    report = group_row(group).reservation
    assert report["state"] == "holding"
    expected = datetime.fromisoformat(report["expected_free_at"])
    assert abs((expected - started).total_seconds() - 7200) < 1  # r0's timeout; r1 ends sooner

    fits = make_task(acme, gpu_required=1, priority=40, max_duration_seconds=3600)
    outlasts = make_task(acme, gpu_required=1, priority=40, timeout_seconds=10_000, max_duration_seconds=9000)
    undeclared = make_task(acme, gpu_required=1, priority=40)
    result = run_cycle()
    assert result.bound == [fits.pk]
    assert [status(outlasts), status(undeclared)] == ["pending", "pending"]
    assert Task.objects.get(pk=undeclared.pk).schedule_reason["removed_by"] == {"reserved": 2}
    held = {entry["node_id"]: entry["held"] for entry in group_row(group).reservation["nodes"]}
    assert sum(map(len, held.values())) == 5  # six free cards, one backfilled
    assert ledger_agrees()
