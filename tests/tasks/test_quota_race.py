"""Two creates at the same moment with room for one: exactly one passes the quota.
Real threads, real connections, the tenant's usage row locked for the check."""

import threading

import pytest
from django.db import connection

from apps.core.errors import Conflict
from apps.tasks.models import Task
from apps.tasks.services import create_task, create_tasks, quota_use
from apps.tenants import services

pytestmark = pytest.mark.django_db(transaction=True)


def test_concurrent_creates_cannot_both_pass_a_quota_with_room_for_one():
    tenant = services.create_tenant(name="Quota Race", slug="quota-race", max_gpus=4)
    try:
        Task.objects.create(tenant=tenant, name="existing", gpu_required=2)
        barrier = threading.Barrier(4)
        outcomes, lock = [], threading.Lock()

        def submit(i):
            try:
                barrier.wait(10)
                create_task(tenant=tenant, name=f"t{i}", image="x", gpu_required=2)
                result = "created"
            except Conflict:
                result = "refused"
            finally:
                connection.close()
            with lock:
                outcomes.append(result)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
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
        barrier = threading.Barrier(8)
        created, lock = [], threading.Lock()

        def submit(i):
            mine = []
            try:
                barrier.wait(10)
                for k in range(6):
                    size = 3 if (i + k) % 2 else 1
                    try:
                        tasks = create_tasks(tenant, [{"name": f"t{i}-{k}", "image": "x", "gpu_required": 1}] * size)
                        mine.append(len(tasks))
                    except Conflict:
                        pass
            finally:
                connection.close()
            with lock:
                created.extend(mine)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        rows = Task.objects.filter(tenant=tenant).count()
        assert rows == sum(created) <= 20
        # 96 tasks asked for room for 20: some request was refused, so the rest of the room
        # is less than a batch (a single is refused only when it is full)
        assert rows >= 18
        assert quota_use(tenant) == {"tasks": rows, "gpus": rows, "gpu_memory_mb": 0}
    finally:
        Task.objects.filter(tenant=tenant).delete()
        services.delete_tenant(tenant)
