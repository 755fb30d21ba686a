"""Reads of tasks shared by the API and the pages. Scoping is Task.objects.visible_to."""

from __future__ import annotations

from django.db.models import Case, CharField, Count, Exists, F, OuterRef, Prefetch, Q, Subquery, Sum, Value, When

from apps.nodes.models import Gpu
from apps.slices.choices import SliceState
from apps.slices.models import Slice
from apps.tasks.choices import BOUND_NOT_ENDING, ENDING, HOLDING, TERMINAL, GroupPlacement, GroupStatus, TaskStatus
from apps.tasks.models import Task, TaskEvent, TaskGroup, UsageRecord

# A memory-only task (only gpu_memory_mb, no whole cards): it runs in a slice of one card
# (apps.slices), and never without a confirmed one ("no limit, no start").
MEMORY_ONLY = Q(gpu_required=0, gpu_memory_mb__gt=0)


def is_memory_only(task: Task) -> bool:
    return task.gpu_required == 0 and bool(task.gpu_memory_mb)


def slice_confirmed(task_ref) -> Exists:
    """Whether the task (an OuterRef to it, or its id) has a confirmed slice."""
    return Exists(Slice.objects.filter(task=task_ref, state=SliceState.CONFIRMED))


def agent_tasks(node_id: str, status: str):
    """The agent's list of a node's tasks in a status. Scheduled ones leave out the
    memory-only tasks whose slice is not confirmed yet: the agent must not start them."""
    tasks = Task.objects.filter(node_id=node_id, status=status)
    if status == TaskStatus.SCHEDULED:
        tasks = tasks.exclude(MEMORY_ONLY & ~slice_confirmed(OuterRef("pk")))
    return tasks


def task_slice(task: Task) -> dict | None:
    """The "slice" of a task's detail and of its agent payload: the slice serving it (or
    the last one it had), None unless the task is memory-only or before it was bound."""
    if not is_memory_only(task):
        return None
    card_memory = Gpu.objects.filter(node_id=OuterRef("node_id"), index=OuterRef("gpu_index")).values(
        "memory_total_mb"
    )[:1]
    found = (
        Slice.objects.filter(task_id=task.pk).annotate(memory_total_mb=Subquery(card_memory)).order_by("-pk").first()
    )
    if found is None:
        return None
    return {
        "id": found.pk,
        "tier": found.tier,
        "qos": str(found.qos),
        "state": found.state,
        "gpu_index": found.gpu_index,
        "gpu_uuid": found.gpu_uuid,
        "memory_mb": found.memory_mb,
        "memory_total_mb": found.memory_total_mb,
        "compute_percent": found.compute_percent,
        "profile": found.profile,
        "device_id": found.device_id,
        "reason": found.reason,
    }


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
