"""Snapshots for the pure scheduler core's tests (no database): cards, nodes, tasks, groups."""

from apps.scheduler.core import GpuSnap, GroupReq, NodeSnap, TaskReq


def gpus(n, vendor="nvidia", memory=81920, **kw):
    return [GpuSnap(index=i, vendor=vendor, memory_total_mb=memory, **kw) for i in range(n)]


def node(id, n=8, status="online", **kw):
    return NodeSnap(id=id, status=status, executable=kw.pop("executable", True), gpus=kw.pop("gpus", gpus(n)), **kw)


def task(id=1, gpus=1, tenant=1, **kw):
    return TaskReq(id=id, tenant_id=tenant, gpu_required=gpus, **kw)


def group(id=1, workers=4, gpus=8, gpu_type="nvidia", tenant=1, first_member=1000, **kw):
    """A task group of `workers` ranks (task ids from `first_member`), `gpus` cards each."""
    return GroupReq(
        id=id,
        tenant_id=tenant,
        members=tuple(range(first_member, first_member + workers)),
        gpus_per_worker=gpus,
        gpu_type=gpu_type,
        **kw,
    )


SAME_TENANT_ONLY = lambda a, b: a == b  # noqa: E731
