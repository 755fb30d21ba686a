"""Reads of tasks shared by the API and the pages. Scoping is Task.objects.visible_to."""

from __future__ import annotations

from django.db.models import Case, CharField, Count, F, Prefetch, Q, Sum, Value, When

from apps.tasks.choices import BOUND_NOT_ENDING, ENDING, HOLDING, TERMINAL, GroupPlacement, GroupStatus, TaskStatus
from apps.tasks.models import Task, TaskEvent, TaskGroup, UsageRecord


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


# --- task groups ---------------------------------------------------------------------------

# The member counts choices.group_status decides from, for its SQL form below.
_GROUP_COUNTS = {
    "_members": Q(),
    "_ended": Q(tasks__status__in=TERMINAL),
    "_failed": Q(tasks__status=TaskStatus.FAILED),
    "_stopped": Q(tasks__status__in=(TaskStatus.STOPPED, TaskStatus.CANCELLED)),
    "_ended_not_completed": Q(tasks__status__in=TERMINAL) & ~Q(tasks__status=TaskStatus.COMPLETED),
    "_ending": Q(tasks__status__in=ENDING),
    "_pending": Q(tasks__status=TaskStatus.PENDING),
    "_running_or_completed": Q(tasks__status__in=(TaskStatus.RUNNING, TaskStatus.COMPLETED)),
    # a replicas group's
    "_running": Q(tasks__status=TaskStatus.RUNNING),
    "_bound_not_ending": Q(tasks__status__in=BOUND_NOT_ENDING),
}


def with_group_status(groups):
    """Each group with `derived_status`: choices.group_status written in SQL over its
    members' statuses, so a list filters on it in the database (a test holds the two to
    the same answers, case by case)."""
    all_ended = Q(_ended=F("_members"))
    replicas = Q(placement=GroupPlacement.REPLICAS)
    return groups.annotate(
        **{name: Count("tasks", filter=condition or None) for name, condition in _GROUP_COUNTS.items()}
    ).annotate(
        derived_status=Case(
            When(_members=0, then=Value(GroupStatus.PENDING)),
            When(all_ended & Q(_failed__gt=0), then=Value(GroupStatus.FAILED)),
            When(all_ended & Q(_stopped__gt=0), then=Value(GroupStatus.STOPPED)),
            When(all_ended, then=Value(GroupStatus.COMPLETED)),
            When(replicas & Q(_running__gt=0), then=Value(GroupStatus.RUNNING)),
            When(replicas & Q(_bound_not_ending__gt=0), then=Value(GroupStatus.SCHEDULED)),
            When(replicas & Q(_pending__gt=0), then=Value(GroupStatus.PENDING)),
            When(replicas, then=Value(GroupStatus.STOPPING)),
            When(Q(_ending__gt=0) | Q(_ended_not_completed__gt=0), then=Value(GroupStatus.STOPPING)),
            When(_pending=F("_members"), then=Value(GroupStatus.PENDING)),
            When(_running_or_completed=F("_members"), then=Value(GroupStatus.RUNNING)),
            default=Value(GroupStatus.SCHEDULED),
            output_field=CharField(),
        )
    )


def task_group_list(groups, *, status: str = ""):
    """Visible groups (`groups`, already scoped) newest first, each with its status; only
    those of `status` when given."""
    groups = groups.with_status().select_related("tenant", "created_by").order_by("-created_at", "-id")
    if status:
        groups = with_group_status(groups).filter(derived_status=status)
    return groups


def task_group_detail(groups):
    """Visible groups (`groups`, already scoped) ready to show one: its status, and its
    members in rank order with the cards each holds."""
    members = Task.objects.order_by("rank").select_related("node").prefetch_related("allocations")
    return (
        groups.with_status()
        .select_related("tenant", "created_by")
        .prefetch_related(Prefetch("tasks", queryset=members))
    )


def task_group_events(group: TaskGroup):
    """Its members' events, newest first, each with the member's `rank`."""
    return (
        TaskEvent.objects.filter(task__group_id=group.pk).annotate(rank=F("task__rank")).order_by("-created_at", "-id")
    )
