"""One authentication class per kind of credential. Each puts a Principal in `request.auth`.

- `Authorization: Bearer sk-admin-…`  → platform operator (key of a staff user)
- `Authorization: Bearer sk-tenant-…` → a member's tenant key, role capped by the membership
- `X-API-Key: …`                      → the node agents' shared secret (agent endpoints only)
- Django session                     → operator (staff) or a tenant user
"""

from __future__ import annotations

import hmac
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from rest_framework import authentication, exceptions

from apps.core.clock import utcnow
from apps.core.principals import AGENT, Principal, PrincipalKind
from apps.gateway.choices import ENDPOINT_KEY_PREFIX
from apps.tenants import keys
from apps.tenants.choices import ROLE_RANK, KeyScope

LAST_USED_RESOLUTION = timedelta(minutes=1)
TENANT_HEADER = "HTTP_X_HETEROFLOW_TENANT"
SESSION_TENANT_KEY = "heteroflow_tenant"


class BearerKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return authenticate_bearer(token)

    def authenticate_header(self, request):
        return BEARER_CHALLENGE


BEARER_CHALLENGE = 'Bearer realm="heteroflow"'


def authenticate_bearer(token: str):
    """(user, Principal) for the token of an `Authorization: Bearer` header, as every
    API request checks it (the DRF class above, the thin create route); raises
    AuthenticationFailed for a key that is empty, unknown, expired, revoked or whose
    owner may no longer use it."""
    token = token.strip()
    if not token:
        raise exceptions.AuthenticationFailed("Empty bearer token.")
    if token.startswith(ENDPOINT_KEY_PREFIX):
        raise exceptions.AuthenticationFailed(
            "An endpoint key (sk-hf-) calls the OpenAI-compatible /v1/* endpoints only; "
            "this API takes a tenant key (sk-tenant-) or a platform key (sk-admin-)."
        )
    api_key = keys.find_usable(token, now=utcnow())
    if api_key is None:
        raise exceptions.AuthenticationFailed("Invalid, expired or revoked API key.")
    principal = principal_for_key(api_key)
    if principal is None:
        raise exceptions.AuthenticationFailed("This API key's owner can no longer use it.")
    keys.touch(api_key, now=utcnow(), resolution=LAST_USED_RESOLUTION)
    return api_key.user, principal


def principal_for_key(api_key) -> Principal | None:
    user = api_key.user
    if not user.is_active:
        return None
    if api_key.scope == KeyScope.PLATFORM:
        return Principal(PrincipalKind.OPERATOR, user=user, api_key=api_key) if user.is_staff else None
    membership = api_key.tenant.memberships.filter(user=user).first()
    if membership is None:
        return None
    role = min(api_key.role, membership.role, key=lambda r: ROLE_RANK[r])
    return Principal(PrincipalKind.TENANT_KEY, user=user, tenant=api_key.tenant, role=role, api_key=api_key)


class AgentKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        offered = request.META.get("HTTP_X_API_KEY")
        if offered is None:
            return None
        expected = settings.HETEROFLOW_AGENT_SECRET or ""
        if not expected or not hmac.compare_digest(offered.encode(), expected.encode()):
            raise exceptions.AuthenticationFailed("Invalid agent key.")
        return AnonymousUser(), AGENT


class PrincipalSessionAuthentication(authentication.SessionAuthentication):
    def authenticate(self, request):
        result = super().authenticate(request)
        if result is None:
            return None
        user, _ = result
        return user, principal_for_session(request, user)


def principal_for_session(request, user) -> Principal:
    """A signed-in person's principal: the tenant the request's header names (refused if
    not theirs), else the one chosen in the session, else their first."""
    header = request.META.get(TENANT_HEADER)
    principal = principal_for_user(user, header or request.session.get(SESSION_TENANT_KEY))
    if header and not principal.is_operator and getattr(principal.tenant, "slug", None) != header:
        raise exceptions.PermissionDenied(f"You are not a member of tenant '{header}'.")
    return principal


def principal_for_user(user, tenant_slug: str | None = None) -> Principal:
    """A person's principal in the tenant `tenant_slug` (their first tenant when it is
    not one of theirs, or not given); an operator's whatever the tenant."""
    if user.is_staff:
        return Principal(PrincipalKind.OPERATOR, user=user)
    memberships = list(user.memberships.by_tenant_name())
    chosen = next((m for m in memberships if m.tenant.slug == tenant_slug), None) if tenant_slug else None
    chosen = chosen or (memberships[0] if memberships else None)
    if chosen is None:
        return Principal(PrincipalKind.NO_TENANT, user=user)
    return Principal(PrincipalKind.TENANT_USER, user=user, tenant=chosen.tenant, role=chosen.role)
