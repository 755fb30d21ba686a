"""API keys and members. Validation by the API's serializers, changes by
apps.tenants.services (which hold the rules: role ceilings, last admin, who may revoke)."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST
from rest_framework import exceptions as api_errors

from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.core.views import get_visible_or_404
from apps.identity.session import REAUTH_MESSAGE, reauthentication_url, signed_in_recently
from apps.portal.access import portal_page
from apps.portal.pages.common import error_messages, flatten, paginate, through_api
from apps.tenants import policy, services
from apps.tenants.api.serializers import ApiKeyCreateSerializer, MemberCreateSerializer, MemberUpdateSerializer
from apps.tenants.choices import KeyScope, Role
from apps.tenants.models import ApiKey, Membership, Tenant

# --- API keys ---------------------------------------------------------------------------------


def key_request(post, principal) -> dict:
    """The form as the body of POST /api/v1/keys: operators issue platform keys here,
    everyone else keys of their tenant (admins may name another member)."""
    data = {"name": post.get("name", "").strip()}
    if post.get("expires_at"):
        data["expires_at"] = post["expires_at"]
    if principal.is_operator:
        data["scope"] = KeyScope.PLATFORM
        return data
    data["scope"] = KeyScope.TENANT
    if post.get("role"):
        data["role"] = post["role"]
    if post.get("username") and principal.is_tenant_admin:
        data["username"] = post["username"].strip()
    return data


def issue(principal, data: dict):
    if data["scope"] == KeyScope.PLATFORM:
        return services.issue_platform_key(user=principal.user, name=data["name"], expires_at=data.get("expires_at"))
    return services.issue_tenant_key(
        principal=principal,
        tenant=policy.acting_tenant(principal, None, required=policy.KEY_TENANT_REQUIRED),
        owner=policy.key_owner(principal, data.get("username")),
        name=data["name"],
        role=data.get("role"),
        expires_at=data.get("expires_at"),
    )


@portal_page
def keys(request):
    principal = request.principal
    if not (principal.is_operator or principal.is_tenant):
        raise PermissionDenied("You are not a member of any tenant.")
    errors, issued = {}, None
    if request.method == "POST" and not signed_in_recently(request):
        messages.info(request, REAUTH_MESSAGE)
        return redirect(reauthentication_url(reverse("portal:keys")))
    if request.method == "POST":
        issued, errors = through_api(
            ApiKeyCreateSerializer, key_request(request.POST, principal), lambda data: issue(principal, data)
        )
    listed = ApiKey.objects.visible_to(principal).select_related("tenant", "user").order_by("-created_at", "-id")
    response = render(
        request,
        "portal/keys.html",
        {
            "page": paginate(request, listed, 50),
            "errors": errors,
            "issued": issued,
            "roles": Role.choices,
            "form": request.POST if errors else {},
            "now": utcnow(),
        },
        status=400 if errors else 200,
    )
    response["Cache-Control"] = "no-store"  # a new key is on this page once
    return response


@require_POST
@portal_page
def key_revoke(request, pk):
    principal = request.principal
    api_key = get_visible_or_404(ApiKey, principal, pk=pk)
    try:
        services.revoke_key(api_key, principal=principal)
    except api_errors.PermissionDenied as exc:
        raise PermissionDenied(str(exc.detail)) from None
    messages.success(request, f"Revoked {api_key.name} ({api_key.display_prefix}…).")
    return redirect("portal:keys")


# --- members ----------------------------------------------------------------------------------


def managed_tenant(request) -> Tenant:
    """Tenant admins manage their own tenant; operators pick one (?tenant=slug)."""
    principal = request.principal
    if principal.is_operator:
        slug = request.GET.get("tenant") or request.POST.get("tenant")
        tenant = policy.tenant_by_slug(principal, slug) if slug else Tenant.objects.order_by("name").first()
        if tenant is None:
            raise PermissionDenied("There are no tenants yet.")
        return tenant
    if not principal.is_tenant_admin:
        raise PermissionDenied("Only this tenant's admins and platform operators can manage members.")
    return principal.tenant


def members_url(tenant, principal) -> str:
    url = reverse("portal:members")
    return f"{url}?tenant={tenant.slug}" if principal.is_operator else url


@portal_page
def members(request):
    principal = request.principal
    tenant = managed_tenant(request)
    errors, added = {}, None
    if request.method == "POST":
        serializer = MemberCreateSerializer(
            data={
                "username": request.POST.get("username", "").strip(),
                "email": request.POST.get("email", "").strip(),
                "role": request.POST.get("role", Role.MEMBER),
            }
        )
        try:
            serializer.is_valid(raise_exception=True)
            added = services.add_member(tenant, principal=principal, **serializer.validated_data)
        except api_errors.ValidationError as exc:
            errors = error_messages(exc)
        except Conflict as exc:
            errors = {"__all__": flatten(exc.detail)}
    listed = (
        Membership.objects.visible_to(principal).filter(tenant=tenant).select_related("user").order_by("user__username")
    )
    response = render(
        request,
        "portal/members.html",
        {
            "tenant": tenant,
            "members": listed,
            "errors": errors,
            "added": added,
            "roles": Role.choices,
            "form": request.POST if errors else {},
            "tenants": Tenant.objects.order_by("name") if principal.is_operator else [],
        },
        status=400 if errors else 200,
    )
    response["Cache-Control"] = "no-store"  # a generated password is shown once
    return response


@require_POST
@portal_page
def member_change(request, pk):
    principal = request.principal
    membership = get_visible_or_404(Membership.objects.select_related("tenant", "user"), principal, pk=pk)
    if not policy.may_manage_tenant(principal, membership.tenant):
        raise PermissionDenied("Only this tenant's admins and platform operators can manage members.")
    try:
        if request.POST.get("action") == "remove":
            services.remove_member(membership, principal=principal)
            messages.success(request, f"Removed {membership.user.username}; their keys of this tenant are revoked.")
        else:
            serializer = MemberUpdateSerializer(data={"role": request.POST.get("role", "")})
            serializer.is_valid(raise_exception=True)
            services.change_member_role(membership, serializer.validated_data["role"], principal=principal)
            messages.success(request, f"{membership.user.username} is now {membership.role}.")
    except api_errors.ValidationError as exc:
        messages.error(request, " ".join(" ".join(v) for v in error_messages(exc).values()))
    except Conflict as exc:
        messages.error(request, str(exc.detail))
    return redirect(members_url(membership.tenant, principal))
