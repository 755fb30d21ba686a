"""The energy and carbon of a tenant's tasks (docs/energy.md#tenants): the same answer
as GET /api/v1/usage/energy, carbon under the role rule, "—" for no data."""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.shortcuts import render

from apps.portal.access import portal_page
from apps.portal.pages.common import choice
from apps.tasks.api.energy import energy_tenant, present_tenant_energy
from apps.tenants.models import Tenant

WINDOWS = {"7": "7 days", "30": "30 days", "90": "90 days", "366": "a year"}


@portal_page
def energy(request):
    principal = request.principal
    if not (principal.is_operator or principal.is_tenant):
        raise PermissionDenied("You are not a member of any tenant.")
    days = choice(request.GET.get("days", ""), WINDOWS, "30")
    slug = None
    if principal.is_operator:  # a tenant's principals see their own tenant
        slug = request.GET.get("tenant", "").strip() or None
    tenant = energy_tenant(principal, slug)
    return render(
        request,
        "portal/energy.html",
        {
            "usage": present_tenant_energy(principal, tenant, days=int(days), top=20),
            "days": days,
            "windows": WINDOWS,
            "tenant": tenant,
            "tenants": Tenant.objects.order_by("name") if principal.is_operator else [],
        },
    )
