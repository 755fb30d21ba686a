"""Reads of tasks shared by the API and the pages. Scoping is Task.objects.visible_to."""

from __future__ import annotations

from django.db.models import Count, Q, Sum

from apps.tasks.choices import HOLDING, TaskStatus
from apps.tasks.models import Task, UsageRecord


def task_list(principal, *, status: str = "", kind: str = "", node_id: str = "", tenant_slug: str = "", q: str = ""):
    tasks = Task.objects.visible_to(principal).select_related("tenant", "created_by")
    if status:
        tasks = tasks.filter(status=status)
    if kind:
        tasks = tasks.filter(kind=kind)
    if node_id:
        tasks = tasks.filter(node_id=node_id)
    if tenant_slug:
        tasks = tasks.filter(tenant__slug=tenant_slug)
    if q:
        tasks = tasks.filter(Q(name__icontains=q) | Q(image__icontains=q))
    return tasks


def task_stats(principal) -> dict:
    """GET /api/v1/tasks/stats and the pages: tasks by status, the GPUs they hold, and the
    GPU time settled for those that ended."""
    tasks = Task.objects.visible_to(principal)
    by_status = dict(tasks.order_by().values_list("status").annotate(n=Count("id")))
    held = tasks.filter(status__in=HOLDING).aggregate(n=Sum("gpu_required"))["n"] or 0
    settled = UsageRecord.objects.filter(task__in=tasks).aggregate(n=Sum("gpu_seconds"))["n"] or 0.0
    return {
        "total": sum(by_status.values()),
        "by_status": {status: by_status.get(status, 0) for status in TaskStatus.values},
        "gpus_held": held,
        "gpu_seconds_settled": settled,
    }


def scheduling_summary(principal) -> dict:
    """How placement went for the visible tasks: `placed` were put on a node at some time
    (they have a node, or started); `unplaced` are waiting with a reason from the last
    cycle, or ended without ever being placed. The rate is placed / (placed + unplaced),
    None when nothing was decided yet."""
    tasks = Task.objects.visible_to(principal).order_by()
    never_placed = Q(node__isnull=True, started_at__isnull=True)
    counts = tasks.aggregate(
        placed=Count("id", filter=Q(node__isnull=False) | Q(started_at__isnull=False)),
        unplaced=Count(
            "id",
            filter=never_placed
            & (
                (Q(status=TaskStatus.PENDING) & ~Q(schedule_reason={}))
                | Q(status__in=(TaskStatus.FAILED, TaskStatus.CANCELLED)) & ~Q(schedule_reason={})
            ),
        ),
    )
    decided = counts["placed"] + counts["unplaced"]
    counts["rate"] = round(100.0 * counts["placed"] / decided, 1) if decided else None
    return counts
