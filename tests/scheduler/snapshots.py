"""Snapshots for the pure scheduler core's tests (no database): cards, nodes, tasks."""

from apps.scheduler.core import GpuSnap, NodeSnap, TaskReq


def gpus(n, vendor="nvidia", memory=81920, **kw):
    return [GpuSnap(index=i, vendor=vendor, memory_total_mb=memory, **kw) for i in range(n)]


def node(id, n=8, status="online", **kw):
    return NodeSnap(id=id, status=status, executable=kw.pop("executable", True), gpus=kw.pop("gpus", gpus(n)), **kw)


def task(id=1, gpus=1, tenant=1, **kw):
    return TaskReq(id=id, tenant_id=tenant, gpu_required=gpus, **kw)


SAME_TENANT_ONLY = lambda a, b: a == b  # noqa: E731
