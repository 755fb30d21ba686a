"""Four scheduler processes, each with its own database connection, released together
over 2,000 pending tasks and 50 nodes × 8 GPUs: every task bound at most once, no card
over capacity at any sampled moment, and the ledger equal to the sum over active tasks."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.db import connection
from django.db.models import Count, Sum

from apps.core.clock import utcnow
from apps.nodes.models import Gpu, Node
from apps.scheduler.models import GpuAllocation
from apps.tasks.choices import HOLDING
from apps.tasks.models import Task
from apps.tenants import services as tenant_services
from tests.factories import make_node

pytestmark = pytest.mark.django_db(transaction=True)
REPO = Path(__file__).resolve().parents[2]

SCHEDULER = r"""
import os, sys, time
import django
django.setup()
from apps.scheduler.services import run_cycle
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.005)
idle = 0
while idle < 3:
    result = run_cycle()
    idle = idle + 1 if not result.bound and not result.lost_races else 0
print("done", flush=True)
"""


def over_capacity() -> list:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT a.node_id, a.gpu_index, count(*) FROM gpu_allocations a WHERE a.memory_mb IS NULL "
            "GROUP BY a.node_id, a.gpu_index HAVING count(*) > 1"
        )
        doubled = cursor.fetchall()
        cursor.execute(
            "SELECT t.id FROM tasks t LEFT JOIN gpu_allocations a ON a.task_id = t.id "
            "GROUP BY t.id, t.gpu_required, t.status HAVING count(a.id) > t.gpu_required "
            "OR count(DISTINCT a.node_id) > 1"
        )
        return doubled + cursor.fetchall()


def test_four_schedulers_never_double_bind():
    tenant = tenant_services.create_tenant(name="Proof", slug="proof")
    try:
        now = utcnow()
        for n in range(50):
            make_node(f"p{n:02d}", gpus=8, model="", last_heartbeat_at=now)
        Task.objects.bulk_create(
            Task(tenant=tenant, name=f"t{i}", image="x", gpu_required=1 + i % 2, priority=i % 100) for i in range(2000)
        )
        db = connection.settings_dict
        env = dict(
            os.environ,
            DATABASE_URL=f"postgresql://{db['USER']}@{db['HOST'] or 'localhost'}:{db['PORT'] or 5432}/{db['NAME']}",
        )
        if db["HOST"] and db["HOST"].startswith("/"):
            from urllib.parse import quote

            env["DATABASE_URL"] = f"postgresql://{db['USER']}@{quote(db['HOST'], safe='')}/{db['NAME']}"
        start = time.time() + 3
        schedulers = [
            subprocess.Popen(
                [sys.executable, "-c", SCHEDULER, str(start)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        samples = 0
        while any(p.poll() is None for p in schedulers):
            assert over_capacity() == [], "a card or a task was over capacity"
            samples += 1
            time.sleep(0.05)
        for process in schedulers:
            out, err = process.communicate()
            assert process.returncode == 0 and "done" in out, err[-2000:]
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
