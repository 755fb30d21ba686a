"""Queues (docs/queues.md): for operators every tenant's, for a tenant's people their own,
as GET /api/v1/admin/queues and GET /api/v1/queue answer them: a bar per GPU type
(nominal, used within nominal, borrowed, lent), the fair-share order and the decayed
usage."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.shortcuts import render

from apps.core.clock import utcnow
from apps.portal.access import portal_page
from apps.scheduler import quotas
from apps.scheduler.core.queues import fair_order
from apps.tenants.models import Tenant


def bar(row: dict) -> dict:
    """A type's bar: its parts as shares of the larger of nominal and what is held."""
    nominal, used, borrowed, lent = row["nominal"], row["used"], row["borrowed"], row["lent"]
    scale = max(nominal, used, 1e-9)
    within = min(used, nominal)
    idle = max(nominal - within - lent, 0.0)
    return row | {
        "parts": [
            {"kind": "within", "label": f"{within:g} used within nominal", "percent": 100 * within / scale},
            {"kind": "borrowed", "label": f"{borrowed:g} borrowed", "percent": 100 * borrowed / scale},
            {"kind": "lent", "label": f"{lent:g} lent", "percent": 100 * lent / scale},
            {"kind": "idle", "label": f"{idle:g} idle", "percent": 100 * idle / scale},
        ]
    }


@portal_page
def queues(request):
    principal = request.principal
    if not (principal.is_operator or principal.is_tenant):
        raise PermissionDenied("You are not a member of any tenant.")
    book = quotas.queue_book(utcnow())
    shown = Tenant.objects.order_by("slug") if principal.is_operator else [principal.tenant]
    views = []
    for tenant in shown:
        view = quotas.tenant_view(book, tenant.pk)
        if view.get("queue", 0) is None:
            views.append({"tenant": tenant.slug, "name": tenant.name, "queue": None})
            continue
        views.append(
            {"tenant": tenant.slug, "name": tenant.name, "queue": view | {"types": [bar(row) for row in view["types"]]}}
        )
    cohorts = {}
    for cohort, specs in sorted(book.cohorts.items()):
        if principal.is_operator or any(spec.tenant_id == principal.tenant.pk for spec in specs):
            order = fair_order(book, [spec.tenant_id for spec in specs])
            cohorts[cohort] = [
                {
                    "tenant": book.specs[tenant_id].name,
                    "weight": book.specs[tenant_id].weight,
                    "gpu_hours": book.history.get(tenant_id, 0.0) / 3600.0,
                    "share": book.dominant_share(tenant_id) / 3600.0,
                }
                for tenant_id in order
            ]
    return render(request, "portal/queues.html", {"views": views, "cohorts": cohorts})
