"""Two operators creating the same tenant at the same moment: exactly one wins, the other
gets a conflict, and exactly one schema exists. Real threads, real connections."""

import threading

import pytest
from django.db import connection

from apps.core.errors import Conflict
from apps.tenants import services
from apps.tenants.models import Tenant

pytestmark = pytest.mark.django_db(transaction=True)


def test_concurrent_creates_of_one_tenant_make_one_tenant_and_one_schema():
    barrier = threading.Barrier(2)
    outcomes, lock = [], threading.Lock()

    def create(name):
        try:
            barrier.wait(10)
            services.create_tenant(name=name, slug="race")
            result = "created"
        except Conflict:
            result = "conflict"
        finally:
            connection.close()
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=create, args=(name,)) for name in ("Race", "Race Two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert sorted(outcomes) == ["conflict", "created"]
        assert Tenant.objects.filter(slug="race").count() == 1
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 't_race'")
            assert cursor.fetchone()[0] == 1
    finally:
        for tenant in Tenant.objects.filter(slug="race"):
            services.delete_tenant(tenant)
