"""The single tasks' queue (apps.scheduler.queue): a cycle takes at most BATCH_SIZE (200)
of them, in queue order after the cursor the previous cycle left, and wraps around to the
head, so a long queue of tasks that cannot run does not starve the ones behind it."""

import pytest

from apps.scheduler import queue
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task
from tests.factories import make_node

pytestmark = pytest.mark.django_db


def pending(tenant, count, **fields):
    """`count` pending single tasks in one INSERT, ids (and creation) in order."""
    made = Task.objects.bulk_create(
        Task(tenant=tenant, name=f"q-{i}", image="x", gpu_required=1, gpu_type="nvidia", **fields) for i in range(count)
    )
    return [task.pk for task in made]


def queue_order(ids):
    rows = Task.objects.filter(pk__in=ids).values_list("pk", "priority", "created_at")
    return [pk for pk, _, _ in sorted(rows, key=lambda row: (-row[1], row[2], row[0]))]


def test_a_batch_is_two_hundred_in_queue_order_then_the_cursor_hands_over_and_wraps(world):
    acme = world.tenants["acme"]
    low = pending(acme, 300, priority=10)
    high = pending(acme, 150, priority=90)
    order = queue_order(low + high)
    assert order[:150] == high  # priority first, then age

    first = [task.id for task in queue.next_batch()]
    assert len(first) == queue.BATCH_SIZE == 200 and first == order[:200]
    second = [task.id for task in queue.next_batch()]
    assert second == order[200:400]  # from the cursor on: no task twice
    # 50 left after the cursor, then around to the head for the other 150, and each
    # batch is decided in queue order even when it wrapped
    third = [task.id for task in queue.next_batch()]
    assert third == order[:150] + order[400:] and len(third) == 200 == len(set(third))


def test_tasks_placed_meanwhile_are_skipped_and_a_new_one_is_reached_on_the_wrap(world):
    acme = world.tenants["acme"]
    ids = pending(acme, 250, priority=50)
    assert [task.id for task in queue.next_batch()] == ids[:200]
    Task.objects.filter(pk__in=ids[200:210]).update(status="scheduled")  # placed by another way
    (urgent,) = pending(acme, 1, priority=99)  # ahead of the cursor: reached on the wrap
    assert [task.id for task in queue.next_batch()] == [urgent] + ids[:159] + ids[210:]


def test_one_cycle_binds_at_most_two_hundred_and_the_next_cycle_the_rest(world):
    acme = world.tenants["acme"]
    for n in range(27):
        make_node(f"cap-{n}", gpus=8)
    ids = pending(acme, 205)
    first = run_cycle()
    assert len(first.bound) == 200 and set(first.bound) == set(ids[:200])
    second = run_cycle()
    assert sorted(second.bound) == ids[200:]
    assert Task.objects.filter(pk__in=ids, status="scheduled").count() == 205
