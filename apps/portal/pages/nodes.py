"""Nodes, node monitor and environment pages. Reads come from apps.nodes.selectors and
apps.nodes.metrics (the API's own functions); changes go through apps.nodes.services
with the API's serializers, so a page says what the API would say."""

from __future__ import annotations

from django.contrib import messages
from django.db.models import Prefetch
from django.http import JsonResponse
from django.shortcuts import redirect, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST
from rest_framework.exceptions import ValidationError

from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.core.views import get_visible_or_404
from apps.nodes import metrics, selectors, services
from apps.nodes.api.serializers import LocationSerializer, TenantAssignmentSerializer
from apps.nodes.choices import ALIVE, IMAGE_CHECK_MAX_REFERENCES, is_dirty_build
from apps.nodes.images import node_alive, watched_by_vendor, watched_for
from apps.nodes.model_cache import node_models
from apps.nodes.models import Gpu, Node
from apps.portal.access import operators_only, portal_page
from apps.portal.pages.common import choice, error_messages, paginate
from apps.slices.selectors import slices_by_card
from apps.tasks.choices import ACTIVE
from apps.tasks.models import Task
from apps.tasks.selectors import scheduling_summary
from apps.tenants import policy
from apps.tenants.models import Tenant

NODES_REFRESH_SECONDS = 30  # the nodes page reads its cards again this often (spec 000)
SORT_LABELS = {"tasks": "Tasks", "busy": "GPUs busy", "utilization": "Utilisation", "name": "Name"}
MONITOR_RANGES = {"1": "1 h", "6": "6 h", "24": "24 h", "72": "3 d", "168": "7 d"}
MONITOR_LIST_LIMIT = 200
ENERGY_DAYS = 14  # the monitor's daily energy table
ENVIRONMENT_TABS = {"alive": "Online (checkable)", "offline": "Offline", "all": "All"}
IMAGE_POLL_MS = 5000  # the environment page follows a check or a pull this often
IMAGE_CHECK_WAIT_MS = 120_000  # and stops following a check its node's agent has not taken by then


def gpus_with_state():
    """A node's cards, each with its `state` read in the same query."""
    return Gpu.objects.with_state().order_by("index")


def node_list_context(request) -> dict:
    """What the nodes page shows, for the page and for its refresh (the same query
    string: search, order, page)."""
    principal = request.principal
    q = request.GET.get("q", "").strip()[:200]
    sort = choice(request.GET.get("sort", ""), selectors.NODE_SORTS, "tasks")
    cards = selectors.node_cards(principal, q=q, sort=sort).prefetch_related(
        Prefetch("gpus", queryset=gpus_with_state())
    )
    page = paginate(request, cards)
    for node in page:
        node.cards = list(node.gpus.all())
        present = [gpu for gpu in node.cards if not gpu.lost_at]
        totals = [gpu.memory_total_mb for gpu in present if gpu.memory_total_mb]
        used = [gpu.memory_used_mb for gpu in present if gpu.memory_used_mb is not None]
        node.gpu_memory_total_mb = sum(totals) if totals else None
        node.gpu_memory_in_use_mb = sum(used) if used else None
        node.agent_dirty = is_dirty_build(node.agent_git_commit)
    return {
        "page": page,
        "q": q,
        "sort": sort,
        "sorts": SORT_LABELS,
        "gpus": selectors.gpu_summary(principal),
        "scheduling": scheduling_summary(principal),
        "fleet": selectors.agent_fleet(principal),
        "rendered_at": utcnow(),
    }


@portal_page
def node_list(request):
    context = node_list_context(request)
    context["refresh"] = {"url": reverse("portal:node-cards"), "seconds": NODES_REFRESH_SECONDS}
    return render(request, "portal/nodes.html", context)


@never_cache
@require_GET
@portal_page
def node_cards(request):
    """The nodes page's refresh (static/portal/nodes.js, every NODES_REFRESH_SECONDS): the
    page's parts for the same query string, each card rendered by the page's own template
    (so the refresh shows exactly what a reload would), with the figures beside them."""
    context = node_list_context(request)
    page = context["page"]

    def part(template: str, **extra) -> str:
        return render_to_string(template, context | extra, request)

    return JsonResponse(
        {
            "at": context["rendered_at"],
            "refresh_seconds": NODES_REFRESH_SECONDS,
            "summary": context["gpus"] | context["scheduling"],
            "fleet": context["fleet"],
            "page": {"number": page.number, "pages": page.paginator.num_pages, "count": page.paginator.count},
            "nodes": [
                {
                    "id": node.pk,
                    "name": node.name,
                    "status": node.status,
                    "agent_version": node.agent_version,
                    "agent_git_commit": node.agent_git_commit,
                    "agent_dirty": node.agent_dirty,
                    "html": part("portal/_node_card.html", node=node),
                }
                for node in page
            ],
            "html": {
                "strip": part("portal/_nodes_strip.html"),
                "fleet": part("portal/_agent_fleet.html"),
                "pagination": part("portal/_pagination.html"),
            },
        }
    )


@portal_page
def node_detail(request, node_id):
    principal = request.principal
    node = get_visible_or_404(Node, principal, pk=node_id)
    gpus = list(gpus_with_state().filter(node=node))
    tasks = (
        Task.objects.visible_to(principal)
        .filter(node=node, status__in=ACTIVE)
        .select_related("tenant")
        .order_by("id")[:50]
    )
    others = [int(x) for x in request.GET.get("others", "").split(",") if x.isdigit()]
    return render(
        request,
        "portal/node_detail.html",
        {
            "node": node,
            "gpus": gpus,
            "tasks": tasks,
            "models": node_models(node),
            "labels": sorted(node.labels.items()),
            "tenants": Tenant.objects.order_by("name") if principal.is_operator else [],
            "can_delete": policy.may_delete_node(principal, node),
            "other_tenant_tasks": others,
            "card_slices": slices_by_card(node, principal, shares=True),
        },
    )


def back_to(node_id: str, **query) -> str:
    url = reverse("portal:node", args=[node_id])
    if query:
        from django.utils.http import urlencode

        url += "?" + urlencode(query)
    return url


@require_POST
@portal_page
@operators_only
def node_location(request, node_id):
    node = get_visible_or_404(Node, request.principal, pk=node_id)
    data = {field: request.POST[field] for field in services.LOCATION_FIELDS if field in request.POST}
    serializer = LocationSerializer(data=data)
    if not serializer.is_valid():
        for field, problems in error_messages(ValidationError(serializer.errors)).items():
            messages.error(request, f"{field}: {' '.join(problems)}")
        return redirect(back_to(node.pk))
    services.set_location(node, {k: v.strip() for k, v in serializer.validated_data.items()})
    messages.success(request, "Location saved.")
    return redirect(back_to(node.pk))


@require_POST
@portal_page
@operators_only
def node_tenant(request, node_id):
    node = get_visible_or_404(Node, request.principal, pk=node_id)
    serializer = TenantAssignmentSerializer(
        data={
            "tenant": request.POST.get("tenant") or None,
            "version": request.POST.get("version"),
            "mode": request.POST.get("mode", "drain"),
        }
    )
    if not serializer.is_valid():
        for field, problems in error_messages(ValidationError(serializer.errors)).items():
            messages.error(request, f"{field}: {' '.join(problems)}")
        return redirect(back_to(node.pk))
    data = serializer.validated_data
    try:
        tenant = None if data["tenant"] is None else policy.named_tenant(request.principal, data["tenant"])
    except ValidationError as exc:
        for field, problems in error_messages(exc).items():
            messages.error(request, f"{field}: {' '.join(problems)}")
        return redirect(back_to(node.pk))
    try:
        result = services.assign_tenant(node, tenant, expected_version=data["version"], mode=data["mode"])
    except Conflict as exc:
        messages.error(request, str(exc.detail))
        return redirect(back_to(node.pk))
    owner = tenant.name if tenant else "shared"
    if result.mode == "evict":
        stopping = ", ".join(f"#{pk}" for pk in result.stopping) or "none"
        left = sorted(set(result.other_tenant_tasks) - set(result.stopping))
        messages.success(
            request,
            f"Node is now {owner}. Asked to stop: {stopping}."
            + (f" Could not be stopped now: {', '.join(f'#{pk}' for pk in left)}." if left else ""),
        )
        return redirect(back_to(node.pk))
    messages.success(request, f"Node is now {owner}.")
    if result.other_tenant_tasks:
        # drain first; the page offers to stop the other tenants' tasks now instead
        return redirect(back_to(node.pk, others=",".join(str(pk) for pk in result.other_tenant_tasks)))
    return redirect(back_to(node.pk))


@require_POST
@portal_page
def node_delete(request, node_id):
    principal = request.principal
    node = get_visible_or_404(Node, request.principal, pk=node_id)
    policy.check_may_delete_node(principal, node)
    try:
        deleted = services.delete_node(node, force=request.POST.get("force") == "true", principal=principal)
    except Conflict as exc:
        messages.error(request, str(exc.detail))  # the 409 reason, word for word
        return redirect(back_to(node.pk))
    removed, models = "", deleted.cleared  # what the pre-checks cleared: the models registered on it
    if models.get("deleted_models"):
        removed += f" Models deleted with it: {', '.join(models['deleted_models'])}."
    if models.get("unregistered_models"):
        removed += f" Models no longer registered on it: {', '.join(models['unregistered_models'])}."
    messages.success(request, f"Deleted node '{deleted.node_id}'.{removed}")
    return redirect("portal:nodes")


# --- the node monitor -----------------------------------------------------------------------

READINGS = ("utilization", "memory_used_mb", "temperature", "power_w")


def supported(gpus, reading: str) -> bool:
    """A reading is supported when some card reports it (the agent lists what it read in
    metrics_available; an agent that sends no list read what it sent)."""
    return any(
        reading in (gpu.metrics_available or []) or (not gpu.metrics_available and getattr(gpu, reading) is not None)
        for gpu in gpus
    )


def live_readings(node: Node, gpus: list) -> dict:
    present = [gpu for gpu in gpus if not gpu.lost_at]

    def values(reading):
        return [getattr(gpu, reading) for gpu in present if getattr(gpu, reading) is not None]

    def mean(items):
        return sum(items) / len(items) if items else None

    used = values("memory_used_mb")
    totals = [gpu.memory_total_mb for gpu in present if gpu.memory_total_mb]
    return {
        "supported": {reading: supported(present, reading) for reading in READINGS},
        "utilization": mean(values("utilization")),
        "memory_used_mb": sum(used) if used else None,
        "memory_total_mb": sum(totals) if totals else None,
        "memory_percent": 100.0 * sum(used) / sum(totals) if used and totals else None,
        "temperature": max(values("temperature"), default=None),
        "power_w": sum(values("power_w")) if values("power_w") else None,
        "cpu_used": node.cpu_used,
        "memory_used": node.memory_used,
    }


@portal_page
def node_monitor(request):
    principal = request.principal
    q = request.GET.get("q", "").strip()[:200]
    listed = selectors.node_list(principal, q=q).order_by("name", "id").only("id", "name", "status")
    alive = list(listed.filter(status__in=ALIVE)[:MONITOR_LIST_LIMIT])
    offline = list(listed.exclude(status__in=ALIVE)[:MONITOR_LIST_LIMIT])
    wanted = request.GET.get("node")
    if wanted:
        node = get_visible_or_404(Node, principal, pk=wanted)
    else:
        first = (alive or offline or [None])[0]
        node = Node.objects.get(pk=first.pk) if first else None
    hours = choice(request.GET.get("hours", ""), MONITOR_RANGES, "1")
    context = {"q": q, "alive": alive, "offline": offline, "node": node, "hours": hours, "ranges": MONITOR_RANGES}
    if node is not None:
        gpus = list(node.gpus.order_by("index"))
        indices = [str(gpu.index) for gpu in gpus]
        gpu = choice(request.GET.get("gpu", ""), indices, "all")
        shown = gpus if gpu == "all" else [g for g in gpus if str(g.index) == gpu]
        energy = metrics.node_energy(node, principal, hours=int(hours), days=ENERGY_DAYS)
        context |= {
            "gpus": gpus,
            "gpu": gpu,
            "live": live_readings(node, shown),
            "energy": energy,
            "chart_data": {
                "node_id": node.pk,
                "hours": int(hours),
                "gpu": gpu,
                "supported": {reading: supported(shown, reading) for reading in READINGS},
                "history": metrics.history(node.pk, int(hours)),
                "metrics_url": reverse("node-metrics", args=[node.pk]),
                "energy_url": reverse("node-energy", args=[node.pk]),
                "energy_series": energy["series"],
                "node_url": reverse("node-detail", args=[node.pk]),
            },
        }
    return render(request, "portal/node_monitor.html", context)


# --- the environment ------------------------------------------------------------------------


@portal_page
def environment(request):
    principal = request.principal
    tab = choice(request.GET.get("tab", ""), ENVIRONMENT_TABS, "alive")
    page = paginate(
        request, selectors.nodes_by_liveness(principal, tab).select_related("tenant").order_by("name", "id"), 50
    )
    return render(
        request,
        "portal/environment.html",
        {
            "summary": selectors.environment_summary(principal),
            "tab": tab,
            "tabs": ENVIRONMENT_TABS,
            "page": page,
            # the image part is the operators' (the image channel's API is theirs)
            "images": environment_images(page) if principal.is_operator else None,
        },
    )


def environment_images(page) -> dict:
    """What the page's script needs to check the watched images of the live nodes on
    this page (docs/images.md): per node its watched list and the channel's URLs. An
    offline node is listed as not checkable and gets no URL, so no request is made for it.
    Rendering makes no request: the script asks (POST check), then follows it."""
    now = utcnow()
    grouped = watched_by_vendor()
    nodes = {}
    for node in page:
        if not node_alive(node, now):
            nodes[node.pk] = {"checkable": False}
            continue
        watched = watched_for(node, grouped)[:IMAGE_CHECK_MAX_REFERENCES]
        nodes[node.pk] = {
            "checkable": True,
            "watched": [{"reference": w.reference, "kind": w.kind} for w in watched],
            "check_url": reverse("node-images-check", args=[node.pk]),
            "pull_url": reverse("node-images-pull", args=[node.pk]),
        }
    return {
        "nodes": nodes,
        "request_url": reverse("image-request-detail", args=[0]).rstrip("0"),
        "poll_ms": IMAGE_POLL_MS,
        "check_wait_ms": IMAGE_CHECK_WAIT_MS,
    }
