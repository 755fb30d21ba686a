"""Endpoint keys (sk-hf-, for the OpenAI-compatible /v1/*): list, create (shown once),
rotate (the new secret shown once, the old one valid for the grace period), revoke.
Validation by the API's serializers, changes by apps.gateway.services."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import render
from django.views.decorators.http import require_POST
from rest_framework import exceptions as api_errors

from apps.core.clock import utcnow
from apps.core.views import get_visible_or_404
from apps.gateway import selectors, services
from apps.gateway.api.serializers import EndpointKeyCreateSerializer, EndpointKeyRotateSerializer
from apps.gateway.api.views import KEY_TENANT_REQUIRED
from apps.gateway.models import EndpointKey, UsageBucket
from apps.portal.access import portal_page
from apps.portal.pages.common import paginate, through_api, through_api_for_a_tenant
from apps.tenants import policy


def key_request(post, principal) -> dict:
    """The form as the body of POST /api/v1/gateway/keys."""
    data = {"name": post.get("name", "").strip()}
    models = [name.strip() for name in post.get("allowed_models", "").split(",") if name.strip()]
    if models:
        data["allowed_models"] = models
    for field in ("rpm_limit", "tpm_limit", "concurrency_limit", "expires_at"):
        if post.get(field, "").strip():
            data[field] = post[field].strip()
    if principal.is_operator and post.get("tenant"):
        data["tenant"] = post["tenant"].strip()
    return data


def create(principal, data: dict):
    data = dict(data)
    tenant = policy.acting_tenant(principal, data.pop("tenant", None), required=KEY_TENANT_REQUIRED)
    return services.create_key(principal, tenant=tenant, **data)


def page(request, *, errors=None, issued=None, form=None, status=200):
    principal = request.principal
    listed = EndpointKey.objects.visible_to(principal).select_related("tenant").order_by("-created_at", "-id")
    response = render(
        request,
        "portal/endpoint_keys.html",
        {
            "page": paginate(request, listed, 50),
            "errors": errors or {},
            "issued": issued,
            "form": form or {},
            "now": utcnow(),
            "may_manage": principal.is_operator
            or (principal.is_tenant and policy.may_manage_endpoint_keys(principal, principal.tenant)),
        },
        status=status,
    )
    response["Cache-Control"] = "no-store"  # a new secret is on this page once
    return response


@portal_page
def endpoint_keys(request):
    principal = request.principal
    if not (principal.is_operator or principal.is_tenant):
        raise PermissionDenied("You are not a member of any tenant.")
    if request.method != "POST":
        return page(request)
    issued, errors = through_api_for_a_tenant(
        EndpointKeyCreateSerializer, key_request(request.POST, principal), lambda data: create(principal, data)
    )
    return page(
        request, errors=errors, issued=issued, form=request.POST if errors else {}, status=400 if errors else 200
    )


@require_POST
@portal_page
def endpoint_key_rotate(request, pk):
    principal = request.principal
    endpoint_key = get_visible_or_404(EndpointKey.objects.select_related("tenant"), principal, pk=pk)
    data = {"grace_seconds": request.POST["grace_seconds"]} if request.POST.get("grace_seconds") else {}
    issued, errors = through_api(
        EndpointKeyRotateSerializer, data, lambda valid: services.rotate_key(principal, endpoint_key, **valid)
    )
    return page(request, errors=errors, issued=issued, status=400 if errors else 200)


@require_POST
@portal_page
def endpoint_key_revoke(request, pk):
    principal = request.principal
    endpoint_key = get_visible_or_404(EndpointKey.objects.select_related("tenant"), principal, pk=pk)
    try:
        services.revoke_key(principal, endpoint_key)
    except api_errors.PermissionDenied as exc:
        raise PermissionDenied(str(exc.detail)) from None
    messages.success(request, f"Revoked {endpoint_key.name} ({endpoint_key.display_prefix}…).")
    return page(request)


USAGE_HOURS = 24


@portal_page
def usage(request):
    """The last day's gateway usage: requests per minute as bars, totals per key and model."""
    principal = request.principal
    if not (principal.is_operator or principal.is_tenant):
        raise PermissionDenied("You are not a member of any tenant.")
    since = utcnow() - timedelta(hours=USAGE_HOURS)
    buckets = UsageBucket.objects.visible_to(principal)
    minutes = selectors.usage_per_minute(buckets, since)
    peak = max((m["requests"] for m in minutes), default=0) or 1
    for minute in minutes:
        minute["height"] = max(2, round(100 * minute["requests"] / peak))
    return render(
        request,
        "portal/gateway_usage.html",
        {
            "minutes": minutes,
            "peak": peak,
            "totals": selectors.usage_totals(selectors.usage_rows(buckets, since=since)),
            "hours": USAGE_HOURS,
        },
    )
