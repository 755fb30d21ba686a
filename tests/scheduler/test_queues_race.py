"""A queue's reclaim raced by two scheduler processes running the real tick (the guarded
periodic job, as every worker and instance runs it): the borrowed work is stopped once
and only as much as the lender's work needs, work within the borrower's nominal is
never touched, and no card is over-sold at any sampled moment."""

from __future__ import annotations

import pytest

from apps.nodes.models import Gpu, Node
from apps.scheduler import quotas
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task
from apps.tasks.services import agent_report
from apps.tenants import services as tenant_services
from apps.tenants.models import Cohort
from tests.factories import make_node, make_task
from tests.scheduler.racers import over_capacity, race

pytestmark = pytest.mark.django_db(transaction=True)

TICKS = r"""
import sys, time
import django
django.setup()
from apps.scheduler.jobs import tick_job
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.005)
for _ in range(40):
    tick_job(immediate=True)
    time.sleep(0.02)
print("done", flush=True)
"""


def test_two_schedulers_reclaim_once_and_only_what_is_needed():
    lender = tenant_services.create_tenant(name="Lender", slug="lender")
    borrower = tenant_services.create_tenant(name="Borrower", slug="borrower")
    try:
        make_node("rq1", gpus=4)
        quotas.set_queue(lender, cohort="lab", weight=1.0, quotas=[quotas.QuotaInput("nvidia", 2)])
        quotas.set_queue(borrower, cohort="lab", weight=1.0, quotas=[quotas.QuotaInput("nvidia", 2)])
        held = []
        for i in range(4):  # the borrower holds all 4 cards: 2 of them the lender's idle nominal
            task = make_task(borrower, name=f"b{i}", gpu_required=1, gpu_type="nvidia", priority=90)
            run_cycle()
            task.refresh_from_db()
            assert agent_report(task, from_status="scheduled", to_status="running")
            held.append(task)
        wanted = [make_task(lender, name=f"l{i}", gpu_required=1, gpu_type="nvidia", priority=1) for i in range(2)]

        samples, seen = race(over_capacity, count=2, script=TICKS)
        assert seen == [] and samples > 3 and over_capacity() == []

        stopped = list(Task.objects.filter(tenant=borrower, status="preempting").values_list("pk", flat=True))
        assert sorted(stopped) == sorted(task.pk for task in held[2:])  # the two beyond its nominal, once each
        assert set(Task.objects.filter(pk__in=[t.pk for t in held[:2]]).values_list("status", flat=True)) == {"running"}
        for task in Task.objects.filter(pk__in=stopped):
            assert task.schedule_reason["message"] == "reclaimed by lender (its nominal)"
        for task in Task.objects.filter(pk__in=[t.pk for t in wanted]):
            assert task.schedule_reason["code"] == "PreemptionPending"
    finally:
        GpuAllocation.objects.filter(node_id="rq1").delete()
        Task.objects.filter(tenant__in=[lender, borrower]).delete()
        Gpu.objects.filter(node_id="rq1").delete()
        Node.objects.filter(id="rq1").delete()
        tenant_services.delete_tenant(lender)
        tenant_services.delete_tenant(borrower)
        Cohort.objects.filter(name="lab").delete()
