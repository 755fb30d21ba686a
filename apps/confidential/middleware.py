"""The audit log's net under every request (apps.core.audit): a change a person made that
no service recorded with a meaningful action of its own is recorded by the request
itself, so that no endpoint (the API, the portal's forms, the admin; one added later too)
changes anything unrecorded.

What counts as a change: an unsafe method (POST, PUT, PATCH, DELETE) by a person (an
operator, a tenant's user or key: never an agent, never an anonymous caller) that
succeeded — a 2xx under /api/, a redirect after a form (Post/Redirect/Get) elsewhere. A
refused request changed nothing and is not recorded. Signing in and out is not a change.

The record names the route (`POST /api/v1/tasks/<int:pk>/stop`), its ids, the names of
the fields sent (never their values: a body may carry a secret), the answer's status and
the id it created. It goes to the tenant's log when the change is in one tenant (the
tenant principal's own, the `slug` of a tenant route, or the `tenant` the answer or the
body names), and to the operators' log when an operator made it.
"""

from __future__ import annotations

import json
import logging

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async

from apps.confidential.services import record_audit
from apps.core import audit
from apps.tenants.models import Tenant

logger = logging.getLogger(__name__)

UNSAFE = frozenset({"POST", "PUT", "PATCH", "DELETE"})
NOT_CHANGES = (
    "/portal/login",
    "/portal/logout",
    "/admin/login/",
    "/admin/logout/",
    "/api/v1/agent/",
    "/api/v1/scheduler/dry-run",  # asks, changes nothing
)
REDIRECTS = frozenset({301, 302, 303})
HIDDEN_FIELDS = frozenset({"csrfmiddlewaretoken"})


class AuditMiddleware:
    """Sync and async: under ASGI a request that changes nothing passes with no thread
    hop; a change's record is written off the event loop."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        if not may_change(request):
            return self.get_response(request)
        token = audit.begin()
        try:
            response = self.get_response(request)
            after(request, response)
            return response
        finally:
            audit.end(token)

    async def _acall(self, request):
        if not may_change(request):
            return await self.get_response(request)
        token = audit.begin()
        try:
            response = await self.get_response(request)
            await sync_to_async(after, thread_sensitive=True)(request, response)
            return response
        finally:
            audit.end(token)


def may_change(request) -> bool:
    if request.method not in UNSAFE or request.path.startswith(NOT_CHANGES):
        return False
    if request.content_type == "application/json":
        request.body  # noqa: B018 (read now, so that its fields can be named after the view read it)
    return True


def after(request, response) -> None:
    """Record the request's change, unless a service recorded it or it changed nothing."""
    if audit.was_recorded() or not succeeded(request.path, response.status_code):
        return
    principal = principal_of(request)
    if principal is None:
        return
    try:
        record_request(request, response, principal)
    except Exception:  # the change is made; its record must not turn it into a 500
        logger.exception("the audit record of %s %s was not written", request.method, request.path)


def succeeded(path: str, status: int) -> bool:
    if path.startswith("/api/"):
        return 200 <= status < 300
    return status in REDIRECTS


def principal_of(request):
    """The person behind the request: DRF's principal (request.auth), the portal's, or the
    admin's signed-in operator. None for agents and anonymous callers."""
    for principal in (getattr(request, "auth", None), getattr(request, "principal", None)):
        if principal is not None and hasattr(principal, "is_agent"):
            return None if principal.is_agent else principal
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and request.path.startswith("/admin/"):
        return AdminUser(user)
    return None


class AdminUser:
    """An operator in Django's admin (which has no principal of ours)."""

    is_agent, is_tenant, is_operator, api_key, tenant = False, False, True, None, None

    def __init__(self, user):
        self.user = user


def record_request(request, response, principal) -> None:
    match = request.resolver_match
    route = f"/{match.route}" if match is not None and match.route else request.path
    kwargs = dict(match.kwargs) if match is not None else {}
    answer = json_of(response)
    sent = fields_sent(request)
    created = answer.get("id") if isinstance(answer, dict) and response.status_code == 201 else None
    target = ",".join(f"{name}={value}" for name, value in kwargs.items()) or (f"id={created}" if created else "")
    details = {"status": response.status_code, "fields": sorted(sent)}
    if created is not None:
        details["created"] = created
    tenant = tenant_of(principal, kwargs, answer, sent)
    action = f"{request.method} {route}"
    if tenant is not None:
        record_audit(tenant, principal, action, target, **details)
    elif principal.is_operator:
        audit.record_operator_audit(principal, action, target, **details)


def json_of(response):
    if "json" not in response.get("Content-Type", "") or getattr(response, "streaming", False):
        return None
    try:
        return json.loads(response.content or b"null")
    except ValueError:
        return None


def fields_sent(request) -> dict:
    """The body's fields (a JSON object or a form), for their names."""
    if request.content_type == "application/json":
        try:
            body = json.loads(request.body or b"{}")
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}
    return {name: request.POST.get(name) for name in request.POST if name not in HIDDEN_FIELDS}


def tenant_of(principal, kwargs: dict, answer, sent: dict) -> Tenant | None:
    """The tenant the change was in, when it was in one."""
    if principal.is_tenant:
        return principal.tenant
    for slug in (kwargs.get("slug"), answer.get("tenant") if isinstance(answer, dict) else None, sent.get("tenant")):
        if isinstance(slug, str) and slug:
            found = Tenant.objects.filter(slug=slug).first()
            if found is not None:
                return found
    return None
