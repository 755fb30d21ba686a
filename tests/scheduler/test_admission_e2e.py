"""Admission on what is really free, end to end (issue 21): heartbeats posted through the
real route report a card's memory use, the real scheduler cycle places against it,
explain names both numbers, and the drift alert follows the use. (Apart from the
module-scoped world fixture, whose open transaction would hide rows.)"""

from datetime import timedelta

import pytest
import time_machine

from apps.alerts import keys as alert_keys
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.nodes.models import Gpu
from apps.scheduler import services
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task
from apps.tasks.services import create_task
from apps.tenants import services as tenant_services
from tests.nodes.payloads import gpu_stat, heartbeat

GB = 1024
TOTAL = 80 * GB


def beat(agents, used, node_id="n1", at=None):
    card = gpu_stat(0, memory_total_mb=TOTAL, memory_used_mb=used, utilization=3.0, temperature=40.0)
    with time_machine.travel(at or utcnow(), tick=False):
        response = agents.send(node_id, heartbeat(gpus=1, gpu_stats=[card]))
    assert response.status_code == 200, response.content


def share(tenant, gb, name):
    return create_task(tenant=tenant, name=name, image="x", gpu_required=0, gpu_memory_mb=gb * GB)


@pytest.mark.django_db(transaction=True)
def test_unknown_use_blocks_a_60_gb_task_admits_a_40_gb_one_and_raises_the_drift_alert(agents):
    tenant = tenant_services.create_tenant(name="Admission", slug="admission-e2e")
    try:
        beat(agents, used=30 * GB)  # 30 GB in use on the card, and nothing in the ledger
        big = share(tenant, 60, "big")
        result = run_cycle()
        assert result.bound == [] and result.failed[big.pk]["removed_by"] == {"memory_in_use": 1}
        big.refresh_from_db()
        assert big.schedule_reason["removed_by"] == {"memory_in_use": 1}
        outcome, detail = services.explain_now(services.pending_request(big))
        assert outcome.removed == {"memory_in_use": 1}
        assert detail["nodes"] == [{"node_id": "n1", "filter": "memory_in_use"}]
        assert detail["cards"] == [
            {
                "node_id": "n1",
                "gpu_index": 0,
                "ledger_free_mb": TOTAL,  # ~80 GB by the ledger
                "measured_free_mb": 50 * GB,  # ~50 GB by the reading
                "reserve_mb": 8192,
                "needed_mb": 60 * GB,
            }
        ]

        # the use lasts: the drift alert after 3 beats of 5 s
        assert Gpu.objects.get(node_id="n1", index=0).memory_drift_mb == 30 * GB
        beat(agents, used=30 * GB, at=utcnow() + timedelta(seconds=15))
        alert = Alert.objects.get(key=alert_keys.gpu_memory_drift("n1", 0), state="ACTIVE")
        assert alert.details["measured_mb"] == 30 * GB and alert.details["explained_mb"] == 0

        small = share(tenant, 40, "small")
        assert run_cycle().bound == [small.pk]  # 50 GB measured free, 42 GB after the reserve
        assert GpuAllocation.objects.get(task=small).memory_mb == 40 * GB
        assert Task.objects.get(pk=big.pk).status == "pending"

        # the unknown process goes away: the drift ends once that has lasted 3 beats of 5 s
        beat(agents, used=1 * GB, at=utcnow() + timedelta(seconds=20))
        assert Alert.objects.get(pk=alert.pk).state == "ACTIVE"
        beat(agents, used=1 * GB, at=utcnow() + timedelta(seconds=35))
        assert Alert.objects.get(pk=alert.pk).state == "RECOVERED"
        assert Gpu.objects.get(node_id="n1", index=0).memory_drift_since is None
    finally:
        Task.objects.filter(tenant=tenant).delete()
        tenant_services.delete_tenant(tenant)


@pytest.mark.django_db(transaction=True)
def test_without_a_reading_the_ledger_alone_admits(agents):
    tenant = tenant_services.create_tenant(name="Admission", slug="admission-none")
    try:
        card = gpu_stat(0, memory_total_mb=TOTAL, utilization=3.0, temperature=40.0)
        del card["memory_used_mb"]
        card["metrics_available"] = ["utilization", "temperature"]
        assert agents.send("n1", heartbeat(gpus=1, gpu_stats=[card])).status_code == 200
        assert Gpu.objects.get(node_id="n1").memory_used_mb is None
        big = share(tenant, 60, "big")
        assert run_cycle().bound == [big.pk]
        assert Gpu.objects.get(node_id="n1").memory_drift_since is None
    finally:
        Task.objects.filter(tenant=tenant).delete()
        tenant_services.delete_tenant(tenant)
