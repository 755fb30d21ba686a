"""Reads of tasks shared by the API and the pages. Scoping is Task.objects.visible_to."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Case, CharField, Count, Exists, F, OuterRef, Prefetch, Q, Subquery, Sum, Value, When

from apps.core.clock import utcnow
from apps.nodes.models import Gpu
from apps.scheduler.ledger import TASK_ENERGY
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


# --- energy of a tenant's tasks (docs/energy.md#tenants) ------------------------------------


def live_energy(task_ids) -> dict[int, tuple[float, float | None, float]]:
    """What the running tasks' cards grew since bind, per task: (Wh × share, carbon g
    under the nodes' factors now or None, Wh no factor covers). A task none of whose
    cards measured power is absent. The same sums the release settles
    (apps.scheduler.ledger.TASK_ENERGY), read without writing."""
    if not task_ids:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT task_id, wh, carbon_g, unfactored_wh FROM ({TASK_ENERGY}) AS e", {"tasks": list(task_ids)}
        )
        return {task_id: (wh, carbon_g, unfactored) for task_id, wh, carbon_g, unfactored in cursor.fetchall()}


def _add(total: float | None, more: float | None) -> float | None:
    """Sums where None is "not measured": None + None stays None, never 0."""
    if more is None:
        return total
    return more if total is None else total + more


def tenant_energy(tenant_id: int | None, *, days: int, top: int = 10, now: datetime | None = None) -> dict:
    """A tenant's tasks' GPU time, energy and carbon over the last `days` (None: every
    tenant's): the tasks settled in the window (usage_records, summed in SQL) and the
    tasks holding cards now, with their live growth. Energy is null when none of them
    measured power, carbon null where no factor covered it (that energy apart, as
    unfactored); the caller applies the role rule (apps.nodes.carbon) before showing
    carbon. `top_tasks`: the `top` tasks by energy, settled and running together."""
    now = now or utcnow()
    since = now - timedelta(days=days)
    records = UsageRecord.objects.filter(settled_at__gte=since)
    running = Task.objects.filter(status__in=HOLDING)
    if tenant_id is not None:
        records = records.filter(tenant_id=tenant_id)
        running = running.filter(tenant_id=tenant_id)
    settled = records.aggregate(
        tasks=Count("id"),
        measured=Count("energy_wh"),
        gpu_seconds=Sum("gpu_seconds"),
        energy_wh=Sum("energy_wh"),
        carbon_g=Sum("carbon_g"),
        unfactored_wh=Sum("energy_wh_unfactored"),
    )
    rows = [
        {
            "id": record.task_id,
            "name": record.task.name,
            "status": record.ended_status,
            "running": False,
            "gpu_seconds": record.gpu_seconds,
            "energy_wh": record.energy_wh,
            "carbon_g": record.carbon_g,
            "unfactored_wh": record.energy_wh_unfactored or 0.0,
        }
        for record in records.filter(energy_wh__isnull=False)
        .select_related("task")
        .order_by(F("energy_wh").desc(), "task_id")[:top]
    ]
    totals = {
        "gpu_seconds": settled["gpu_seconds"] or 0.0,
        "energy_wh": settled["energy_wh"],
        "carbon_g": settled["carbon_g"],
        "unfactored_wh": settled["unfactored_wh"] or 0.0,
    }
    holding = list(
        running.values_list(
            "id",
            "name",
            "status",
            "gpu_seconds",
            "gpu_required",
            "running_since",
            "energy_wh",
            "carbon_g",
            "energy_wh_unfactored",
        )
    )
    live = live_energy([task[0] for task in holding])
    # an inference replica's slot that ended and runs again (requeue_replicas) has a
    # record of its earlier runs, already in the settled sums: only what came since counts
    counted = {
        task_id: (gpu_seconds, energy_wh or 0.0, carbon_g or 0.0, unfactored or 0.0)
        for task_id, gpu_seconds, energy_wh, carbon_g, unfactored in records.filter(
            task_id__in=[task[0] for task in holding]
        ).values_list("task_id", "gpu_seconds", "energy_wh", "carbon_g", "energy_wh_unfactored")
    }
    measured_running = 0
    for pk, name, status, gpu_seconds, gpu_required, running_since, energy_wh, carbon_g, unfactored in holding:
        if running_since is not None:
            gpu_seconds += gpu_required * max(0.0, (now - running_since).total_seconds())
        wh, live_carbon, live_unfactored = live.get(pk, (None, None, 0.0))
        row = {
            "id": pk,
            "name": name,
            "status": status,
            "running": True,
            "gpu_seconds": gpu_seconds,
            "energy_wh": _add(energy_wh, wh),
            "carbon_g": _add(carbon_g, live_carbon),
            "unfactored_wh": (unfactored or 0.0) + (live_unfactored or 0.0),
        }
        before = counted.get(pk, (0.0, 0.0, 0.0, 0.0))
        totals["gpu_seconds"] += row["gpu_seconds"] - before[0]
        if row["energy_wh"] is not None:
            totals["energy_wh"] = _add(totals["energy_wh"], row["energy_wh"] - before[1])
        if row["carbon_g"] is not None:
            totals["carbon_g"] = _add(totals["carbon_g"], row["carbon_g"] - before[2])
        totals["unfactored_wh"] += row["unfactored_wh"] - before[3]
        if row["energy_wh"] is not None:
            measured_running += 1
            rows.append(row)
    return {
        "days": days,
        "since": since,
        "tasks_settled": settled["tasks"],
        "tasks_running": len(holding),
        "tasks_measured": settled["measured"] + measured_running,
        "gpu_hours": totals["gpu_seconds"] / 3600.0,
        "energy_wh": totals["energy_wh"],
        "carbon_g": totals["carbon_g"],
        "unfactored_wh": totals["unfactored_wh"],
        "top_tasks": sorted(rows, key=lambda row: (-row["energy_wh"], row["id"]))[:top],
    }
