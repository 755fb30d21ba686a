"""The 401/403/404/400 conventions for every kind of principal.

no credentials → 401 · credentials that cannot act → 403 · an object outside the
principal's scope → 404 · unknown fields → 400 naming each; bad input writes nothing.
"""

import pytest

from apps.tenants.models import ApiKey, Membership, Tenant
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db


def credentials(world, api, who):
    """Configure `api` as principal `who`; returns the extra request headers."""
    if who == "anonymous":
        return {}
    if who == "bad-key":
        return bearer("sk-tenant-this-key-does-not-exist-anywhere")
    if who == "non-prefixed-key":
        return bearer("abcdef0123456789")
    if who == "operator-key":
        return bearer(world.operator_key)
    if who == "operator-session":
        api.force_login(world.operator)
        return {}
    if who == "agent":
        return AGENT
    if who == "bad-agent":
        return {"HTTP_X_API_KEY": "not-the-agent-secret"}
    if who.endswith("-session"):
        api.force_login(world.users[who.removesuffix("-session")])
        return {}
    return bearer(world.keys[who])


CASES = [
    # listing tenants: everybody with a person's credentials, scoped
    ("anonymous", "get", "/api/v1/tenants", None, 401),
    ("bad-key", "get", "/api/v1/tenants", None, 401),
    ("non-prefixed-key", "get", "/api/v1/tenants", None, 401),
    ("bad-agent", "get", "/api/v1/tenants", None, 401),
    ("agent", "get", "/api/v1/tenants", None, 403),
    ("operator-key", "get", "/api/v1/tenants", None, 200),
    ("operator-session", "get", "/api/v1/tenants", None, 200),
    ("acme-viewer", "get", "/api/v1/tenants", None, 200),
    ("acme-admin-session", "get", "/api/v1/tenants", None, 200),
    # creating tenants: operators only
    ("anonymous", "post", "/api/v1/tenants", {"name": "Gamma", "slug": "gamma"}, 401),
    ("agent", "post", "/api/v1/tenants", {"name": "Gamma", "slug": "gamma"}, 403),
    ("acme-admin", "post", "/api/v1/tenants", {"name": "Gamma", "slug": "gamma"}, 403),
    ("acme-admin-session", "post", "/api/v1/tenants", {"name": "Gamma", "slug": "gamma"}, 403),
    ("operator-key", "post", "/api/v1/tenants", {"name": "Gamma", "slug": "gamma"}, 201),
    ("operator-key", "post", "/api/v1/tenants", {"name": "Gamma", "slug": "gamma", "colour": "red"}, 400),
    # one tenant's objects are invisible to another's principals
    ("acme-admin", "get", "/api/v1/tenants/beta", None, 404),
    ("acme-admin-session", "get", "/api/v1/tenants/beta", None, 404),
    ("acme-viewer", "get", "/api/v1/tenants/acme", None, 200),
    ("operator-key", "get", "/api/v1/tenants/beta", None, 200),
    ("agent", "get", "/api/v1/tenants/beta", None, 403),
    ("acme-admin", "delete", "/api/v1/tenants/beta", None, 404),
    ("acme-admin", "delete", "/api/v1/tenants/acme", None, 403),
    ("acme-admin", "patch", "/api/v1/tenants/acme", {"max_gpus": 100}, 403),
    ("operator-key", "get", "/api/v1/tenants/nope", None, 404),
    # members: tenant admins manage their own tenant only
    ("acme-admin", "get", "/api/v1/tenants/acme/members", None, 200),
    ("acme-viewer", "get", "/api/v1/tenants/acme/members", None, 200),
    ("acme-admin", "get", "/api/v1/tenants/beta/members", None, 404),
    ("acme-admin", "post", "/api/v1/tenants/beta/members", {"username": "zed"}, 404),
    ("acme-member", "post", "/api/v1/tenants/acme/members", {"username": "zed"}, 403),
    ("acme-viewer", "post", "/api/v1/tenants/acme/members", {"username": "zed"}, 403),
    ("acme-admin", "post", "/api/v1/tenants/acme/members", {"username": "zed"}, 201),
    ("acme-admin-session", "post", "/api/v1/tenants/acme/members", {"username": "zed"}, 201),
    ("operator-session", "post", "/api/v1/tenants/acme/members", {"username": "zed"}, 201),
    ("acme-admin", "post", "/api/v1/tenants/acme/members", {"username": "zed", "rank": "x"}, 400),
    ("acme-admin", "patch", "/api/v1/tenants/acme/members/acme-viewer", {"role": "member"}, 200),
    ("acme-member", "patch", "/api/v1/tenants/acme/members/acme-viewer", {"role": "member"}, 403),
    ("acme-admin", "patch", "/api/v1/tenants/acme/members/beta-viewer", {"role": "member"}, 404),
    ("acme-admin", "delete", "/api/v1/tenants/beta/members/beta-viewer", None, 404),
    ("agent", "get", "/api/v1/tenants/acme/members", None, 403),
    # the audit log lives in the tenant's schema; admins only
    ("acme-admin", "get", "/api/v1/tenants/acme/audit", None, 200),
    ("acme-member", "get", "/api/v1/tenants/acme/audit", None, 403),
    ("acme-admin", "get", "/api/v1/tenants/beta/audit", None, 404),
    ("operator-key", "get", "/api/v1/tenants/beta/audit", None, 200),
    # tenant groups: operators only
    ("anonymous", "get", "/api/v1/tenant-groups", None, 401),
    ("acme-admin", "get", "/api/v1/tenant-groups", None, 403),
    ("agent", "get", "/api/v1/tenant-groups", None, 403),
    ("operator-key", "get", "/api/v1/tenant-groups", None, 200),
    ("operator-key", "post", "/api/v1/tenant-groups", {"name": "g", "tenants": ["acme", "beta"]}, 201),
    ("operator-key", "post", "/api/v1/tenant-groups", {"name": "g", "members": []}, 400),
    # API keys
    ("anonymous", "get", "/api/v1/api-keys", None, 401),
    ("agent", "get", "/api/v1/api-keys", None, 403),
    ("acme-member", "get", "/api/v1/api-keys", None, 200),
    ("acme-member", "post", "/api/v1/api-keys", {"name": "ci"}, 201),
    ("acme-viewer", "post", "/api/v1/api-keys", {"name": "ci", "role": "admin"}, 400),
    ("acme-member", "post", "/api/v1/api-keys", {"name": "ci", "username": "acme-viewer"}, 403),
    ("acme-admin", "post", "/api/v1/api-keys", {"name": "ci", "username": "acme-viewer"}, 201),
    ("acme-admin", "post", "/api/v1/api-keys", {"name": "ci", "tenant": "beta"}, 404),
    ("acme-admin", "post", "/api/v1/api-keys", {"name": "ci", "scope": "platform"}, 403),
    ("operator-key", "post", "/api/v1/api-keys", {"name": "ops2", "scope": "platform"}, 201),
    ("operator-key", "post", "/api/v1/api-keys", {"name": "k", "tenant": "acme", "username": "acme-member"}, 201),
    ("operator-key", "post", "/api/v1/api-keys", {"name": "k", "tenant": "acme", "username": "beta-admin"}, 400),
    ("operator-key", "post", "/api/v1/api-keys", {"name": "k", "tenant": "acme"}, 400),
    ("acme-admin", "post", "/api/v1/api-keys", {"name": "k", "secret": "x", "owner": "y"}, 400),
    # the agent key reaches agent endpoints only; nobody else reaches them
    ("agent", "get", "/api/v1/agent/auth-check", None, 200),
    ("bad-agent", "get", "/api/v1/agent/auth-check", None, 401),
    ("anonymous", "get", "/api/v1/agent/auth-check", None, 401),
    ("operator-key", "get", "/api/v1/agent/auth-check", None, 403),
    ("acme-admin", "get", "/api/v1/agent/auth-check", None, 403),
    ("acme-admin-session", "get", "/api/v1/agent/auth-check", None, 403),
    # who am I
    ("acme-viewer", "get", "/api/v1/me", None, 200),
    ("agent", "get", "/api/v1/me", None, 403),
    ("anonymous", "get", "/api/v1/me", None, 401),
]


@pytest.mark.parametrize("who,method,path,body,expected", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[4]}" for c in CASES])
def test_access(world, api, who, method, path, body, expected):
    headers = credentials(world, api, who)
    response = getattr(api, method)(path, body, format="json", **headers)
    assert response.status_code == expected, response.content
    if expected >= 400:
        error = response.json()["error"]
        assert set(error) == {"code", "message", "fields"}
        assert error["message"]
    if expected == 401:
        assert response.headers["WWW-Authenticate"].startswith("Bearer")


def test_rejected_input_writes_nothing(world, api):
    before = (Tenant.objects.count(), Membership.objects.count(), ApiKey.objects.count())
    cases = [
        ("/api/v1/tenants", {"name": "Gamma", "slug": "gamma", "colour": "red"}, bearer(world.operator_key)),
        ("/api/v1/tenants", {"name": "Gamma", "slug": "Not A Slug"}, bearer(world.operator_key)),
        ("/api/v1/tenants/acme/members", {"username": "zed", "rank": "x"}, bearer(world.keys["acme-admin"])),
        ("/api/v1/tenants/acme/members", {"username": "zed", "role": "owner"}, bearer(world.keys["acme-admin"])),
        ("/api/v1/api-keys", {"name": "k", "expires_at": "2001-01-01T00:00:00Z"}, bearer(world.keys["acme-admin"])),
    ]
    for path, body, headers in cases:
        response = api.post(path, body, format="json", **headers)
        assert response.status_code == 400, (path, response.content)
    assert (Tenant.objects.count(), Membership.objects.count(), ApiKey.objects.count()) == before


def test_unknown_fields_are_each_named(world, api):
    response = api.post(
        "/api/v1/tenants",
        {"name": "Gamma", "slug": "gamma", "colour": "red", "size": 3},
        format="json",
        **bearer(world.operator_key),
    )
    error = response.json()["error"]
    assert response.status_code == 400
    assert error["code"] == "invalid"
    assert error["fields"] == {"colour": ["Unknown field."], "size": ["Unknown field."]}
    assert "colour" in error["message"] and "size" in error["message"]


def test_unknown_and_invalid_fields_are_reported_together(world, api):
    response = api.post(
        "/api/v1/tenants", {"name": "", "slug": "gamma", "colour": "red"}, format="json", **bearer(world.operator_key)
    )
    fields = response.json()["error"]["fields"]
    assert set(fields) == {"name", "colour"}


def test_malformed_json_is_a_400_in_the_error_shape(world, api):
    response = api.generic(
        "POST", "/api/v1/tenants", "{not json", content_type="application/json", **bearer(world.operator_key)
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parse_error"


def test_unknown_api_path_is_a_json_404(world, api):
    response = api.get("/api/v1/no-such-thing", **bearer(world.operator_key))
    assert response.status_code == 404
    assert response.json() == {"error": {"code": "not_found", "message": "Not found.", "fields": {}}}


def test_tenant_listing_is_scoped(world, api):
    slugs = lambda headers: [t["slug"] for t in api.get("/api/v1/tenants", **headers).json()["results"]]  # noqa: E731
    assert slugs(bearer(world.keys["beta-viewer"])) == ["beta"]
    assert slugs(bearer(world.operator_key)) == ["acme", "beta"]


def test_unknown_api_path_is_json_even_with_debug_pages_on(world, api, settings):
    settings.DEBUG = True
    response = api.get("/api/v1/nothing/here", **bearer(world.operator_key))
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("method", ["post", "put", "patch", "delete"])
@pytest.mark.parametrize("path", ["/api/v1/nothing/here", "/api/nope", "/v1/nothing"])
def test_a_write_to_an_unknown_api_path_is_the_json_404_not_the_csrf_page(path, method):
    """With a browser's session and no CSRF token, as an API client without credentials:
    the JSON error shape, never Django's HTML CSRF page."""
    from django.test import Client

    response = getattr(Client(enforce_csrf_checks=True), method)(path, data="{}", content_type="application/json")
    assert response.status_code == 404 and response["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "not_found"
