"""A small cluster for the portal's page tests: nodes registered through the nodes
service (their cards as the heartbeat would leave them), tasks queued through the tasks
service and placed by a real scheduler cycle, alerts raised through the alerts service."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.models import Alert
from apps.alerts.services import raise_alert
from tests.portal.nodes import add_node


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
