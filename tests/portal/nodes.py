"""Nodes as the portal's page tests want them: registered through the nodes service, their
cards as the heartbeat would leave them (tests/portal/conftest.py's cluster, and the
tests that add a node of their own)."""

from __future__ import annotations

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
