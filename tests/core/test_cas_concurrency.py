"""CAS under real concurrency: each claimant is a thread with its own connection. (Kept
apart from the module-scoped world fixture, whose open transaction would hide rows.)"""

import threading

import pytest
from django.db import connection

from apps.core.cas import transition
from apps.tasks.choices import TRANSITIONS
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task
from apps.tenants import services


@pytest.mark.django_db(transaction=True)
def test_concurrent_claims_have_exactly_one_winner():
    tenant = services.create_tenant(name="Race", slug="race-cas")
    try:
        task = Task.objects.create(tenant=tenant, name="t", status=S.SCHEDULED)
        barrier = threading.Barrier(6)
        winners, errors, lock = [], [], threading.Lock()

        def claim():
            try:
                barrier.wait(10)
                won = transition(Task, TRANSITIONS, task.pk, [S.SCHEDULED], S.RUNNING)
                with lock:
                    winners.extend(won)
            except Exception as exc:
                errors.append(repr(exc))
            finally:
                connection.close()

        threads = [threading.Thread(target=claim) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert errors == []
        assert winners == [task.pk]
    finally:
        Task.objects.all().delete()
        services.delete_tenant(tenant)
