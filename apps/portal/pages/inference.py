"""Inference pages: the tenant's inference services. The deploy form is decoded into the
API's shape and validated by the API's own ServiceCreateSerializer, then deployed through
apps.inference.services like POST /api/v1/inference-services: the same rules and the same
messages. The detail shows the replicas (node, port, health, address), the window and
whether it holds, and the decisions with their reasons; scale, stop and wake go through
apps.inference.services (scale_by_user, stop_service, wake_service), as the API's."""

from __future__ import annotations

import json
from functools import partial

from django.contrib import messages
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST
from rest_framework.exceptions import ValidationError

from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.core.views import get_visible_or_404, visible
from apps.inference import model_ensure, selectors, services
from apps.inference.api.serializers import ServiceCreateSerializer, window_status
from apps.inference.choices import Engine, ServiceStatus
from apps.inference.models import InferenceService, Model, ServiceDecision
from apps.inference.windows import DAYS, WindowAction
from apps.nodes.choices import GpuVendor
from apps.nodes.models import Node
from apps.portal.access import portal_page
from apps.portal.pages.common import choice, error_messages, paginate, through_api_for_a_tenant
from apps.portal.pages.tasks import lines, pairs
from apps.tenants import policy
from apps.tenants.models import Tenant

SERVICES = InferenceService.objects.select_related("group__tenant", "group__created_by", "model")


# --- the form ---------------------------------------------------------------------------------


def number(text: str):
    """A whole number as the window's JSON has it; anything else as it is, for the
    window's own check to name."""
    text = text.strip()
    return int(text) if text.isdigit() else text


def window_from(post) -> dict | None:
    """The window's fields (ticked on): days, one range per line (`09:00-18:00`), the
    time zone, the action and its scale_to."""
    if not post.get("window_on"):
        return None
    ranges = []
    for line in lines(post.get("window_ranges", "")):
        start, _, end = line.replace("–", "-").partition("-")
        ranges.append({"start": start.strip(), "end": end.strip()})
    window = {
        "days": post.getlist("window_days"),
        "ranges": ranges,
        "timezone": post.get("window_timezone", "").strip(),
        "action": post.get("window_action", ""),
    }
    if window["action"] == WindowAction.SCALE or post.get("window_scale_to", "").strip():
        window["scale_to"] = number(post.get("window_scale_to", ""))
    return window


def form_to_request(post, principal) -> tuple[dict, dict[str, list[str]]]:
    """The form's fields as the JSON body POST /api/v1/inference-services takes, and the
    problems found before the API sees it (an autoscaling policy that is not JSON).
    Optional fields left empty are omitted, so the API's defaults apply."""
    data = {
        "name": post.get("name", "").strip(),
        "model": post.get("model", "").strip(),
        "engine": post.get("engine", "auto") or "auto",
        "engine_args": lines(post.get("engine_args", "")),
        "env": pairs(post.get("env", "")),
        "labels": pairs(post.get("labels", "")),
    }
    for field in (
        "gpu_type",
        "gpus_per_replica",
        "gpu_memory_mb",
        "memory_request_mb",
        "min_replicas",
        "max_replicas",
        "sleep_after_seconds",
        "image",
        "priority",
    ):
        value = post.get(field, "").strip()
        if value:
            data[field] = value
    problems: dict[str, list[str]] = {}
    policy_text = post.get("autoscaling", "").strip()
    if policy_text:
        try:
            data["autoscaling"] = json.loads(policy_text)
        except ValueError as exc:
            problems["autoscaling"] = [f"Not JSON: {exc}."]
    if post.get("not_lendable"):  # the box opts out; unticked, the API's default (lendable) applies
        data["lendable"] = False
    window = window_from(post)
    if window is not None:
        data["window"] = window
    if principal.is_operator and post.get("tenant"):
        data["tenant"] = post["tenant"]
    return data, problems


def checked_only(data: dict, principal) -> dict[str, list[str]]:
    """What the API would say about `data`, deploying nothing."""
    try:
        ServiceCreateSerializer(data=data, context={"principal": principal}).is_valid(raise_exception=True)
    except ValidationError as exc:
        return error_messages(exc)
    except Http404:
        return {"tenant": ["Not found."]}
    return {}


@portal_page
def service_new(request):
    principal = request.principal
    policy.check_may_create_tasks(principal, principal.tenant)
    errors: dict[str, list[str]] = {}
    if request.method == "POST":
        data, problems = form_to_request(request.POST, principal)
        if problems:
            errors = {**checked_only(data, principal), **problems}
        else:
            service, errors = through_api_for_a_tenant(
                partial(ServiceCreateSerializer, context={"principal": principal}),
                data,
                lambda valid: services.create_service(principal, valid),
            )
        if not errors:
            messages.success(
                request, f"Service #{service.pk} '{service.group.name}' deployed: {service.replicas} replicas asked."
            )
            return redirect("portal:inference-service", service.pk)
    post = request.POST if request.method == "POST" else None
    return render(
        request,
        "portal/inference_new.html",
        {
            "form": post or {},
            "days_chosen": post.getlist("window_days") if post else ["mon", "tue", "wed", "thu", "fri"],
            "errors": errors,
            "models": visible(Model, principal).select_related("tenant").order_by("tenant__slug", "name"),
            "engines": Engine.choices,
            "vendors": GpuVendor.choices,
            "days": DAYS,
            "window_actions": [action.value for action in WindowAction],
            "tenants": Tenant.objects.order_by("name") if principal.is_operator else [],
            "operator": principal.is_operator,
        },
        status=400 if errors else 200,
    )


# --- list and detail ----------------------------------------------------------------------------


@portal_page
def service_list(request):
    principal = request.principal
    state = choice(request.GET.get("state", ""), ServiceStatus.values)
    rows = visible(SERVICES, principal).order_by("-created_at", "-group_id")
    if state:
        rows = rows.filter(state=state)
    return render(
        request,
        "portal/inference.html",
        {
            "page": paginate(request, rows, 50),
            "state": state,
            "states": ServiceStatus.values,
            "may_create": policy.may_create_tasks(principal, principal.tenant),
        },
    )


def replicas_shown(service) -> list[dict]:
    """replicas_of's rows, each with its node's name (one query for the names)."""
    rows = [dict(row) if isinstance(row, dict) else vars(row).copy() for row in selectors.replicas_of(service)]
    names = dict(Node.objects.filter(pk__in={r.get("node_id") for r in rows} - {None}).values_list("pk", "name"))
    for row in rows:
        row["node_name"] = names.get(row.get("node_id"), row.get("node_id"))
    return rows


def fetching_lines(replicas: list[dict]) -> list[dict]:
    """The replicas whose node downloads their model now, each with its figures and
    the share done (whole percent; None while the total is not known)."""
    found = model_ensure.progress_of([r["task_id"] for r in replicas])
    lines = []
    for row in replicas:
        figures = found.get(row["task_id"])
        if figures:
            total = figures.get("bytes_total")
            percent = int(100 * (figures.get("bytes_done") or 0) / total) if total else None
            lines.append({**figures, "rank": row["rank"], "task_id": row["task_id"], "percent": percent})
    return lines


@portal_page
def service_detail(request, pk):
    principal = request.principal
    service = get_visible_or_404(SERVICES, principal, pk=pk)
    replicas = replicas_shown(service)
    decisions = paginate(request, ServiceDecision.objects.filter(service=service).order_by("-created_at", "-id"), 25)
    manage = services.may_manage(principal, service)
    holds = bool(service.window_action)
    return render(
        request,
        "portal/inference_detail.html",
        {
            "service": service,
            "group": service.group,
            "replicas": replicas,
            "healthy": sum(1 for r in replicas if r.get("healthy")),
            "fetching": fetching_lines(replicas),
            "decisions": decisions,
            "page": decisions,
            "loans": selectors.loans_of_service(service),
            "window": service.window,
            "window_days": ", ".join(service.window.get("days", [])) if service.window else "",
            "window_ranges": ", ".join(
                f"{r.get('start')}–{r.get('end')}" for r in (service.window or {}).get("ranges", [])
            ),
            "window_status": window_status(service, utcnow()),
            "may_scale": manage and service.state not in services.NOT_SCALED and not holds,
            "may_stop": manage and service.state not in (ServiceStatus.STOPPING, ServiceStatus.STOPPED),
            "may_wake": manage and service.state == ServiceStatus.SLEEPING,
            "manage": manage,
            "engine_args": " ".join(service.engine_args or []),
            "autoscaling": json.dumps(service.autoscaling, sort_keys=True) if service.autoscaling else "",
        },
    )


def acted(request, service, act, done: str):
    """Run a button's action; its refusal (a Conflict, a bound) is the page's message."""
    try:
        act()
    except Conflict as exc:
        messages.error(request, str(exc.detail))
    except ValidationError as exc:
        for problems in error_messages(exc).values():
            for problem in problems:
                messages.error(request, problem)
    else:
        service.refresh_from_db()
        messages.success(request, done.format(service=service))
    return redirect("portal:inference-service", service.pk)


@require_POST
@portal_page
def service_scale(request, pk):
    principal = request.principal
    service = get_visible_or_404(SERVICES, principal, pk=pk)
    wanted = request.POST.get("replicas", "").strip()
    if not wanted.isdigit():
        messages.error(request, "Replicas: a whole number.")
        return redirect("portal:inference-service", service.pk)
    return acted(
        request,
        service,
        lambda: services.scale_by_user(principal, service, int(wanted)),
        "Service #{service.pk} asks for {service.replicas} replicas.",
    )


@require_POST
@portal_page
def service_stop(request, pk):
    principal = request.principal
    service = get_visible_or_404(SERVICES, principal, pk=pk)
    return acted(
        request, service, lambda: services.stop_service(principal, service), "Service #{service.pk} is {service.state}."
    )


@require_POST
@portal_page
def service_wake(request, pk):
    principal = request.principal
    service = get_visible_or_404(SERVICES, principal, pk=pk)
    return acted(
        request, service, lambda: services.wake_service(principal, service), "Service #{service.pk} is {service.state}."
    )
