"""Training pages: the tenant's task groups (multi-worker training). The form is decoded
into the API's shape and validated by the API's own TaskGroupCreateSerializer, then
submitted through apps.tasks.submission like POST /api/v1/task-groups: the same rules
and the same messages. Stopping goes through services.stop_group, as the API's stop."""

from __future__ import annotations

import json

from django.contrib import messages
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from apps.core.errors import Conflict
from apps.core.views import get_visible_or_404, visible
from apps.inference.selectors import open_loans_of_group
from apps.nodes.choices import GpuVendor
from apps.portal.access import portal_page
from apps.portal.pages.common import choice, paginate, through_api_for_a_tenant
from apps.portal.pages.logs import group_log_panel
from apps.portal.pages.tasks import REASON_CODES, REMOVED_BY, lines, may_create, pairs
from apps.tasks import services
from apps.tasks.api.serializers import TaskGroupCreateSerializer
from apps.tasks.choices import GroupKind, GroupStatus, GroupStrategy
from apps.tasks.models import TaskGroup
from apps.tasks.selectors import task_group_detail, task_group_list
from apps.tasks.submission import submit_group
from apps.tenants import policy
from apps.tenants.models import Tenant

STRATEGY_HELP = {
    GroupStrategy.DDP: "data parallel: packs workers onto few nodes, spreads when it must",
    GroupStrategy.DEEPSPEED: "DeepSpeed (ZeRO): packed like DDP",
    GroupStrategy.FSDP: "fully sharded data parallel: packed like DDP",
    GroupStrategy.TP: "tensor parallel: workers within one node first (NVLink)",
    GroupStrategy.PP: "pipeline parallel: stages spread across nodes",
}
ENDED = services.ENDED_GROUP
# the parts of a group's schedule_reason the page lays out itself; any other part (a
# reservation, …) is listed as it is, so what the scheduler adds shows without a change here
LAID_OUT = frozenset({"code", "message", "removed_by", "workers", "at", "cause", "reservation"})


# --- the form ---------------------------------------------------------------------------------


def form_to_request(post, principal) -> dict:
    """The form's fields as the JSON body POST /api/v1/task-groups takes. Optional fields
    left empty are omitted, so the API's defaults apply."""
    data = {
        "name": post.get("name", "").strip(),
        "strategy": post.get("strategy", GroupStrategy.DDP),
        "image": post.get("image", "").strip(),
        "command": lines(post.get("command", "")),
        "env": pairs(post.get("env", "")),
        "labels": pairs(post.get("labels", "")),
    }
    for field in (
        "world_size",
        "gpus_per_worker",
        "gpu_type",
        "priority",
        "timeout_seconds",
        "checkpoint_path",
    ):
        value = post.get(field, "").strip()
        if value:
            data[field] = value
    volumes = []
    for line in lines(post.get("volumes", "")):
        host, _, container = line.partition(":")
        container, _, mode = container.partition(":")
        volumes.append({"host": host, "container": container, "read_only": mode == "ro"})
    if volumes:
        data["volumes"] = volumes
    if principal.is_operator and post.get("tenant"):
        data["tenant"] = post["tenant"]
    return data


@portal_page
def training_new(request):
    principal = request.principal
    policy.check_may_create_tasks(principal, principal.tenant)
    errors: dict[str, list[str]] = {}
    if request.method == "POST":
        group, errors = through_api_for_a_tenant(
            TaskGroupCreateSerializer,
            form_to_request(request.POST, principal),
            lambda data: submit_group(principal, data),
        )
        if not errors:
            messages.success(request, f"Training group #{group.pk} queued: {group.world_size} workers.")
            return redirect("portal:training-group", group.pk)
    return render(
        request,
        "portal/training_new.html",
        {
            "form": request.POST if request.method == "POST" else {},
            "errors": errors,
            "strategies": [(value, label, STRATEGY_HELP[value]) for value, label in GroupStrategy.choices],
            "vendors": GpuVendor.choices,
            "tenants": Tenant.objects.order_by("name") if principal.is_operator else [],
        },
        status=400 if errors else 200,
    )


# --- list and detail ----------------------------------------------------------------------------


@portal_page
def training_list(request):
    principal = request.principal
    status = choice(request.GET.get("status", ""), GroupStatus.values)
    # an inference service's group is listed on the Inference page, not here
    groups = visible(TaskGroup.objects.filter(kind=GroupKind.TRAINING), principal)
    page = paginate(request, task_group_list(groups, status=status), 50)
    return render(
        request,
        "portal/training.html",
        {"page": page, "status": status, "statuses": GroupStatus.values, "may_create": may_create(principal)},
    )


def waiting_reason(group: TaskGroup) -> dict | None:
    """Why the scheduler has not placed the group, from its last cycle; None when it said
    nothing. Parts the page does not lay out (a reservation…) come as `more`."""
    reason = group.schedule_reason or {}
    if not reason:
        return None
    return {
        "code": reason.get("code", ""),
        "message": reason.get("message") or REASON_CODES.get(reason.get("code", ""), reason.get("code", "")),
        "removed": [(REMOVED_BY.get(key, key), count) for key, count in (reason.get("removed_by") or {}).items()],
        "workers": reason.get("workers") or {},
        "at": reason.get("at", ""),
        "more": [
            (key.replace("_", " "), value if isinstance(value, str) else json.dumps(value, sort_keys=True))
            for key, value in sorted(reason.items())
            if key not in LAID_OUT
        ],
    }


def reservation_shown(group: TaskGroup) -> dict | None:
    """The group's reservation against starvation (the scheduler's report, shape in
    docs/scheduler.md), as the page lays it out; None when it is not the head of its
    priority."""
    report = group.reservation or {}
    if not report:
        return None
    return {
        "holding": report.get("state") == "holding",
        "head_since": report.get("head_since", ""),
        "reserves_after": report.get("reserves_after", ""),
        "nodes": [
            {"node_id": node.get("node_id", ""), "held": len(node.get("held") or []), "wanted": node.get("wanted", 0)}
            for node in report.get("nodes") or []
        ],
        "nodes_held": report.get("nodes_held", 0),
        "nodes_needed": report.get("nodes_needed", 0),
    }


@portal_page
def training_detail(request, pk):
    principal = request.principal
    group = get_visible_or_404(task_group_detail(TaskGroup.objects.all()), principal, pk=pk)
    members = list(group.tasks.all())
    return render(
        request,
        "portal/training_detail.html",
        {
            "group": group,
            "members": [
                {"task": task, "cards": sorted(a.gpu_index for a in task.allocations.all())} for task in members
            ],
            "nodes": len({task.node_id for task in members if task.node_id}),
            "waiting": waiting_reason(group),
            "reservation": reservation_shown(group),
            "loans": open_loans_of_group(group.pk),
            "may_stop": policy.may_stop_task(principal, group) and group.status not in ENDED,
            "command": " ".join(group.command or []),
            "log_panel": group_log_panel(group, members),
        },
    )


@require_POST
@portal_page
def training_stop(request, pk):
    principal = request.principal
    group = get_visible_or_404(TaskGroup, principal, pk=pk)
    policy.check_may_stop_task(principal, group)
    try:
        group = services.stop_group(group)
    except Conflict as exc:
        messages.error(request, str(exc.detail))
    else:
        messages.success(request, f"Training group #{group.pk} is {group.status}.")
    return redirect("portal:training-group", group.pk)
