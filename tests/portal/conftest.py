"""A small cluster for the portal's page tests: nodes registered through the nodes
service (their cards as the heartbeat would leave them), tasks queued through the tasks
service and placed by a real scheduler cycle, alerts raised through the alerts service."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.models import Alert
from apps.alerts.services import raise_alert
from apps.core.clock import utcnow
from apps.nodes import services as node_services
from apps.nodes.models import Gpu


def add_node(
    node_id: str, *, name: str, gpus: int = 2, tenant=None, status: str = "online", lost: tuple = (), **fields
):
    node, _ = node_services.upsert_node(
        node_id, {"name": name, "exec_mode": "docker", "cpu_cores": 64, "memory_gb": 512.0, **fields}
    )
    now = utcnow()
    type(node).objects.filter(pk=node.pk).update(
        status=status,
        executable=True,
        last_heartbeat_at=now,
        gpu_count=gpus,
        gpu_type="nvidia" if gpus else "",
        gpu_model="NVIDIA H100" if gpus else "",
        tenant=tenant,
        cpu_used=20.0,
        memory_used=40.0,
    )
    for index in range(gpus):
        Gpu.objects.create(
            node=node,
            index=index,
            vendor="nvidia",
            model="NVIDIA H100",
            memory_total_mb=81559,
            utilization=30.0 + index,
            memory_used_mb=1024,
            temperature=50.0,
            power_w=300.0,
            metrics_available=["utilization", "memory_used_mb", "temperature", "power_w"],
            lost_at=now if index in lost else None,
            lost_basis="heartbeat_absent" if index in lost else "",
        )
    node.refresh_from_db()
    return node


@dataclass
class Cluster:
    nodes: dict = field(default_factory=dict)
    alerts: dict = field(default_factory=dict)


@pytest.fixture
def cluster(world):
    c = Cluster()
    c.nodes["shared"] = add_node("shared-1", name="alpha", gpus=4, lost=(3,), rack="r12", zone="az1")
    c.nodes["idle"] = add_node("shared-2", name="bravo", gpus=2)
    c.nodes["beta"] = add_node("beta-1", name="charlie", gpus=2, tenant=world.tenants["beta"])
    c.nodes["offline"] = add_node("shared-3", name="delta", gpus=1, status="offline")
    raise_alert(
        type=AlertType.GPU_LOST,
        severity=Severity.ERROR,
        scope=AlertScope.GPU,
        key="GPU_LOST:shared-1:3",
        node_id="shared-1",
        gpu_index=3,
        message="GPU 3 of node shared-1 is lost.",
    )
    raise_alert(
        type=AlertType.QUOTA_EXCEEDED,
        severity=Severity.WARNING,
        scope=AlertScope.TENANT,
        key="quota:acme",
        tenant_id=world.tenants["acme"].pk,
        message="Tenant acme asked for more GPUs than its quota.",
    )
    raise_alert(
        type=AlertType.QUOTA_EXCEEDED,
        severity=Severity.WARNING,
        scope=AlertScope.TENANT,
        key="quota:beta",
        tenant_id=world.tenants["beta"].pk,
        message="Tenant beta asked for more GPUs than its quota.",
    )
    c.alerts = {alert.key: alert for alert in Alert.objects.all()}
    return c
