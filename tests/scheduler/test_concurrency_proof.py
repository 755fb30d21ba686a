"""Four scheduler processes, each with its own database connection, released together
over 2,000 pending tasks and 50 nodes × 8 GPUs: every task bound at most once, no card
over capacity at any sampled moment, and the ledger equal to the sum over active tasks."""

import pytest
from django.db.models import Count, Sum

from apps.core.clock import utcnow
from apps.nodes.models import Gpu, Node
from apps.scheduler.models import GpuAllocation
from apps.tasks.choices import HOLDING
from apps.tasks.models import Task
from apps.tenants import services as tenant_services
from tests.factories import make_node
from tests.scheduler.racers import over_capacity, race

pytestmark = pytest.mark.django_db(transaction=True)


def test_four_schedulers_never_double_bind():
    tenant = tenant_services.create_tenant(name="Proof", slug="proof")
    try:
        now = utcnow()
        for n in range(50):
            make_node(f"p{n:02d}", gpus=8, model="", last_heartbeat_at=now)
        Task.objects.bulk_create(
            Task(tenant=tenant, name=f"t{i}", image="x", gpu_required=1 + i % 2, priority=i % 100) for i in range(2000)
        )
        samples, seen = race(over_capacity)
        assert seen == [], "a card or a task was over capacity"
        assert samples > 3
        assert over_capacity() == []
        bound = Task.objects.filter(status__in=HOLDING)
        held = bound.aggregate(n=Sum("gpu_required"))["n"]
        assert GpuAllocation.objects.count() == held  # the ledger equals the sum over active tasks
        assert held == 400  # every card of the 50 × 8 is used, none twice
        per_task = GpuAllocation.objects.values("task").annotate(n=Count("id"))
        assert all(row["n"] == Task.objects.get(pk=row["task"]).gpu_required for row in per_task)
    finally:
        GpuAllocation.objects.all().delete()
        Task.objects.filter(tenant=tenant).delete()
        Gpu.objects.filter(node__id__startswith="p").delete()
        Node.objects.filter(id__startswith="p").delete()
        tenant_services.delete_tenant(tenant)
