"""Task pages. The form is decoded into the API's shape and validated by the API's own
TaskCreateSerializer, then submitted through apps.tasks.submission like POST
/api/v1/tasks: the same rules and the same messages."""

from __future__ import annotations

import json

from django.conf import settings
from django.contrib import messages
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.dateparse import parse_datetime
from django.views.decorators.http import require_POST
from rest_framework.exceptions import ValidationError

from apps.core.errors import Conflict
from apps.core.views import get_visible_or_404
from apps.inference.selectors import open_loans_of_task
from apps.nodes.choices import GpuVendor
from apps.portal.access import portal_page
from apps.portal.pages.common import choice, paginate, through_api_for_a_tenant
from apps.portal.pages.logs import task_log_panel
from apps.scheduler import cycle, predictions, queue
from apps.tasks import services
from apps.tasks.api.create import resubmitted
from apps.tasks.api.serializers import TaskCreateSerializer
from apps.tasks.choices import TERMINAL, TaskKind, TaskStatus
from apps.tasks.models import Task
from apps.tasks.selectors import task_list as tasks_for
from apps.tasks.submission import submit_task
from apps.tenants import policy
from apps.tenants.models import Tenant

CANCELLABLE = services.CANCEL_FROM
STOPPABLE = services.STOP_FROM

REMOVED_BY = {
    "unavailable": "not online, or cannot run tasks",
    "tenant": "dedicated to another tenant",
    "load": "over the load thresholds",
    "capacity": "not enough free GPUs or GPU memory",
    "tenant_sharing": "its cards are shared with tenants this one may not share with",
    "rdma": "no RDMA",
    "nvlink": "no NVLink domain large enough",
    "ports": "no free inference port",
}
REASON_CODES = {
    "NoSchedulableNodes": "No node can take tasks at the moment.",
    "InsufficientResources": "No node has room for it at the moment.",
    "NoTenantEligibleGPU": "The only cards with room are shared with tenants this one may not share with.",
    "PreemptionPending": "Lower-priority tasks are being preempted to make room; it is placed once they have stopped.",
    "LoanPending": "Idle inference replicas of its tenant are stopping to lend it their cards; "
    "it is placed once they have stopped.",
}


# --- the form ---------------------------------------------------------------------------------


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def pairs(text: str) -> dict:
    """NAME=value lines; a value that is a JSON object is passed as is (the API's secret
    reference {"secret": "<name>"})."""
    result = {}
    for line in lines(text):
        name, _, value = line.partition("=")
        value = value.strip()
        if value.startswith("{"):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        result[name.strip()] = value
    return result


def form_to_request(post, principal) -> dict:
    """The form's fields as the JSON body POST /api/v1/tasks takes. Optional fields left
    empty are omitted, so the API's defaults apply."""
    data = {
        "name": post.get("name", "").strip(),
        "kind": post.get("kind", TaskKind.JOB),
        "image": post.get("image", "").strip(),
        "command": lines(post.get("command", "")),
        "env": pairs(post.get("env", "")),
        "labels": pairs(post.get("labels", "")),
        "preemptible": post.get("preemptible") == "on",
    }
    for field in ("gpu_required", "gpu_memory_mb", "gpu_type", "priority", "timeout_seconds", "checkpoint_path"):
        value = post.get(field, "").strip()
        if value:
            data[field] = value
    ports = [p.strip() for p in post.get("ports", "").split(",") if p.strip()]
    if ports:
        data["ports"] = ports
    if principal.is_operator and post.get("tenant"):
        data["tenant"] = post["tenant"]
    return data


def may_create(principal) -> bool:
    """Whether the page offers the form: operators (for any tenant) and the members of the
    principal's own tenant."""
    return policy.may_create_tasks(principal, principal.tenant)


@portal_page
def task_new(request):
    principal = request.principal
    policy.check_may_create_tasks(principal, principal.tenant)
    errors: dict[str, list[str]] = {}
    if request.method == "POST":
        task, errors = through_api_for_a_tenant(
            TaskCreateSerializer,
            form_to_request(request.POST, principal),
            lambda data: submit_task(principal, data),
        )
        if not errors:
            messages.success(request, f"Task #{task.pk} queued.")
            return redirect("portal:task", task.pk)
    return render(
        request,
        "portal/task_new.html",
        {
            "form": request.POST if request.method == "POST" else {},
            "errors": errors,
            "kinds": TaskKind.choices,
            "vendors": GpuVendor.choices,
            "tenants": Tenant.objects.order_by("name") if principal.is_operator else [],
        },
        status=400 if errors else 200,
    )


# --- list and detail ----------------------------------------------------------------------------


@portal_page
def task_list(request):
    principal = request.principal
    filters = {
        "status": choice(request.GET.get("status", ""), TaskStatus.values),
        "kind": choice(request.GET.get("kind", ""), TaskKind.values),
        "node_id": request.GET.get("node", "").strip()[:128],
        "tenant_slug": request.GET.get("tenant", "").strip()[:40] if principal.is_operator else "",
        "q": request.GET.get("q", "").strip()[:200],
    }
    page = paginate(request, tasks_for(principal, **filters).order_by("-created_at", "-id"), 50)
    return render(
        request,
        "portal/tasks.html",
        {
            "page": page,
            "filters": filters,
            "statuses": TaskStatus.values,
            "kinds": TaskKind.values,
            "tenants": Tenant.objects.order_by("name") if principal.is_operator else [],
            "may_create": may_create(principal),
        },
    )


def explanation(task: Task) -> dict | None:
    reason = task.schedule_reason or {}
    if not reason:
        return None
    removed = reason.get("removed_by") or {}
    preemption = reason.get("preemption") or {}
    return {
        "code": reason.get("code", ""),
        "text": REASON_CODES.get(reason.get("code", ""), reason.get("code", "")),
        "cause": REASON_CODES.get(reason.get("cause", ""), reason.get("cause", "")),
        "removed": [(REMOVED_BY.get(key, key), count) for key, count in removed.items()],
        "preemption": preemption,
        "loan": reason.get("loan") or {},
        "at": reason.get("at", ""),
    }


def start_estimate(task: Task) -> dict | None:
    """A waiting task's estimated start (apps.scheduler.predictions), as the page shows it:
    the times parsed, or why there is none."""
    found = task.estimated_start if task.status == TaskStatus.PENDING else None
    if not found:
        return None
    return {
        "p50": parse_datetime(found["p50"]) if found.get("p50") else None,
        "p90": parse_datetime(found["p90"]) if found.get("p90") else None,
        "computed_at": parse_datetime(found["computed_at"]) if found.get("computed_at") else None,
        "basis": found.get("basis", ""),
    }


def suggestions_of(task: Task) -> list[dict]:
    """What would start a waiting single task (explain's suggestions, on a fresh dry run),
    each with its change as the page's resubmit form posts it."""
    waiting = queue.pending_request(task) if task.group_id is None else None
    if waiting is None:
        return []
    _, detail = cycle.explain_now(waiting, suggest=True)
    return [
        row
        | {
            "change_json": json.dumps(row["change"], separators=(",", ":")),
            "change_words": ", ".join(f"{field} {json.dumps(value)}" for field, value in row["change"].items()),
        }
        for row in predictions.suggestion_rows(detail, task.estimated_start)
    ]


def history(task: Task) -> list[dict]:
    """What happened to the task: its lifecycle times and its recorded events, in order."""
    items = [{"at": task.created_at, "kind": "created", "message": f"Queued by {task.created_by or 'an API key'}."}]
    if task.started_at:
        items.append({"at": task.started_at, "kind": "started", "message": "Running on its node."})
    items += [
        {"at": e.created_at, "kind": e.kind, "message": e.message, "node": e.node_id} for e in task.events.all()[:200]
    ]
    if task.finished_at:
        items.append({"at": task.finished_at, "kind": task.status, "message": f"Ended as {task.status}."})
    return sorted(items, key=lambda item: item["at"])


@portal_page
def task_detail(request, pk):
    principal = request.principal
    task = get_visible_or_404(Task.objects.select_related("tenant", "node", "created_by"), principal, pk=pk)
    cards = sorted(task.allocations.values_list("gpu_index", flat=True))
    return render(
        request,
        "portal/task_detail.html",
        {
            "task": task,
            "cards": cards,
            "explanation": explanation(task),
            "estimate": start_estimate(task),
            "suggestions": suggestions_of(task),
            "may_resubmit": policy.may_create_tasks(principal, task.tenant) and policy.may_stop_task(principal, task),
            "loans": open_loans_of_task(task.pk) if task.kind == TaskKind.TRAINING else [],
            "history": history(task),
            "may_stop": policy.may_stop_task(principal, task) and task.status in CANCELLABLE + STOPPABLE,
            "may_enter": policy.may_enter_task(principal, task) and task.status == TaskStatus.RUNNING,
            "apps_open": bool(settings.HETEROFLOW_APP_HOST),
            "stop_label": "Cancel" if task.status in CANCELLABLE else "Stop",
            "command": " ".join(task.command or []),
            "log_panel": task_log_panel(task),
            "cards_data": {
                "url": reverse("task-metrics", args=[task.pk]) + "?window=15m",
                "live": task.status not in TERMINAL,
            },
        },
    )


@require_POST
@portal_page
def task_stop(request, pk):
    principal = request.principal
    task = get_visible_or_404(Task, principal, pk=pk)
    policy.check_may_stop_task(principal, task)
    try:
        task = services.stop_task(task)
    except Conflict as exc:
        messages.error(request, str(exc.detail))
    else:
        messages.success(request, f"Task #{task.pk} is {task.status}.")
    return redirect("portal:task", task.pk)


@require_POST
@portal_page
def task_resubmit(request, pk):
    """One of the task page's suggestions, taken: the task queued again with the change
    and cancelled, as POST /api/v1/tasks/{id}/resubmit does."""
    principal = request.principal
    task = get_visible_or_404(Task, principal, pk=pk)
    try:
        change = json.loads(request.POST.get("change", ""))
        new = resubmitted(principal, task, {"change": change})
    except ValueError:
        messages.error(request, "That change could not be read; nothing changed.")
    except (ValidationError, Conflict) as exc:
        messages.error(request, f"Not resubmitted: {flat_detail(exc.detail)}")
    else:
        messages.success(request, f"Task #{new.pk} queued with the change; task #{task.pk} cancelled.")
        return redirect("portal:task", new.pk)
    return redirect("portal:task", task.pk)


def flat_detail(detail) -> str:
    """An API error's detail (a message, a list or a field mapping) as one line."""
    if isinstance(detail, dict):
        return "; ".join(f"{field}: {flat_detail(value)}" for field, value in detail.items())
    if isinstance(detail, list):
        return " ".join(flat_detail(value) for value in detail)
    return str(detail)
