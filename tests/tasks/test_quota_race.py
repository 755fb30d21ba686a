"""Two creates at the same moment with room for one: exactly one passes the quota.
Real threads, real connections, the tenant's advisory lock."""

import threading

import pytest
from django.db import connection

from apps.core.errors import Conflict
from apps.tasks.models import Task
from apps.tasks.services import create_task
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
