"""Creates at the same moment against a quota with room for fewer: never more pass than
fit. Real threads, real connections, the tenant's usage row locked for the check."""

import threading

import pytest
from django.db import connection

from apps.core.errors import Conflict
from apps.tasks.models import Task
from apps.tasks.services import create_task, create_tasks, quota_use
from apps.tenants import services

pytestmark = pytest.mark.django_db(transaction=True)


def together(threads: int, work) -> list:
    """work(i) in `threads` threads released at once, each on its own connection; the
    results in the order they finished."""
    barrier = threading.Barrier(threads)
    results, lock = [], threading.Lock()

    def run(i):
        try:
            barrier.wait(10)
            result = work(i)
        finally:
            connection.close()
        with lock:
            results.append(result)

    started = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join(60)
    return results


def test_concurrent_creates_cannot_both_pass_a_quota_with_room_for_one():
    tenant = services.create_tenant(name="Quota Race", slug="quota-race", max_gpus=4)
    try:
        Task.objects.create(tenant=tenant, name="existing", gpu_required=2)

        def submit(i):
            try:
                create_task(tenant=tenant, name=f"t{i}", image="x", gpu_required=2)
                return "created"
            except Conflict:
                return "refused"

        outcomes = together(4, submit)
        assert sorted(outcomes) == ["created", "refused", "refused", "refused"]
        assert Task.objects.filter(tenant=tenant).count() == 2
    finally:
        Task.objects.filter(tenant=tenant).delete()
        services.delete_tenant(tenant)


def test_racing_creates_and_batches_through_the_counter_never_overrun_the_quota():
    """8 threads, each a mix of single creates and batches of 3, against room for 20
    tasks: a request fits whole or not at all, the quota is never passed, and the
    counter still equals a count of the rows."""
    tenant = services.create_tenant(name="Quota Crowd", slug="quota-crowd", max_concurrent_tasks=20, max_gpus=30)
    try:

        def submit(i):
            created = 0
            for k in range(6):
                size = 3 if (i + k) % 2 else 1
                try:
                    created += len(
                        create_tasks(tenant, [{"name": f"t{i}-{k}", "image": "x", "gpu_required": 1}] * size)
                    )
                except Conflict:
                    pass
            return created

        created = together(8, submit)
        rows = Task.objects.filter(tenant=tenant).count()
        assert rows == sum(created) <= 20
        # 96 tasks asked for room for 20: some request was refused, so the rest of the room
        # is less than a batch (a single is refused only when it is full)
        assert rows >= 18
        assert quota_use(tenant) == {"tasks": rows, "gpus": rows, "gpu_memory_mb": 0}
    finally:
        Task.objects.filter(tenant=tenant).delete()
        services.delete_tenant(tenant)
