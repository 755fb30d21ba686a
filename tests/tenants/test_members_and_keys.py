from datetime import timedelta

import pytest
import time_machine
from django.contrib.auth import get_user_model

from apps.core.clock import utcnow
from apps.tenants import keys
from apps.tenants.models import ApiKey, Membership
from tests.headers import bearer, tenant_header

pytestmark = pytest.mark.django_db
User = get_user_model()


def test_adding_a_new_member_creates_the_user_and_shows_a_generated_password_once(world, api):
    response = api.post(
        "/api/v1/tenants/acme/members",
        {"username": "dora", "email": "dora@example.test", "role": "viewer"},
        format="json",
        **bearer(world.keys["acme-admin"]),
    )
    assert response.status_code == 201
    body = response.json()
    assert body["user_created"] is True and body["role"] == "viewer"
    assert User.objects.get(username="dora").check_password(body["initial_password"])
    listed = api.get("/api/v1/tenants/acme/members", **bearer(world.keys["acme-admin"])).json()["results"]
    assert "initial_password" not in listed[0]


def test_adding_an_existing_user_to_a_second_tenant_keeps_one_user(world, api):
    response = api.post(
        "/api/v1/tenants/beta/members",
        {"username": "acme-viewer", "role": "member"},
        format="json",
        **bearer(world.keys["beta-admin"]),
    )
    assert response.status_code == 201
    assert response.json()["user_created"] is False and response.json()["initial_password"] is None
    assert Membership.objects.filter(user__username="acme-viewer").count() == 2


def test_adding_a_member_twice_is_a_conflict(world, api):
    response = api.post(
        "/api/v1/tenants/acme/members", {"username": "acme-viewer"}, format="json", **bearer(world.keys["acme-admin"])
    )
    assert response.status_code == 409


def test_weak_password_is_refused_and_no_user_is_created(world, api):
    response = api.post(
        "/api/v1/tenants/acme/members",
        {"username": "weak", "password": "123"},
        format="json",
        **bearer(world.keys["acme-admin"]),
    )
    assert response.status_code == 400 and "password" in response.json()["error"]["fields"]
    assert not User.objects.filter(username="weak").exists()


def test_the_last_admin_cannot_be_demoted_or_removed(world, api):
    headers = bearer(world.operator_key)
    response = api.patch("/api/v1/tenants/acme/members/acme-admin", {"role": "member"}, format="json", **headers)
    assert response.status_code == 409 and response.json()["error"]["code"] == "last_admin"
    assert api.delete("/api/v1/tenants/acme/members/acme-admin", **headers).status_code == 409
    api.patch("/api/v1/tenants/acme/members/acme-member", {"role": "admin"}, format="json", **headers)
    assert api.delete("/api/v1/tenants/acme/members/acme-admin", **headers).status_code == 204


def test_removing_a_member_kills_their_keys(world, api):
    assert api.get("/api/v1/me", **bearer(world.keys["acme-member"])).status_code == 200
    assert api.delete("/api/v1/tenants/acme/members/acme-member", **bearer(world.keys["acme-admin"])).status_code == 204
    assert api.get("/api/v1/me", **bearer(world.keys["acme-member"])).status_code == 401


def test_a_key_is_shown_once_and_stored_only_as_a_hash(world, api):
    response = api.post("/api/v1/api-keys", {"name": "ci"}, format="json", **bearer(world.keys["acme-member"]))
    assert response.status_code == 201
    body = response.json()
    key = body["key"]
    assert key.startswith("sk-tenant-") and len(key) > 40
    stored = ApiKey.objects.get(pk=body["id"])
    assert stored.key_hash == keys.hash_key(key) and key not in stored.key_hash
    assert not ApiKey.objects.filter(display_prefix=key).exists()
    detail = api.get(f"/api/v1/api-keys/{body['id']}", **bearer(world.keys["acme-member"])).json()
    assert "key" not in detail
    me = api.get("/api/v1/me", **bearer(key)).json()
    assert me == {
        "kind": "tenant_key",
        "username": "acme-member",
        "tenant": "acme",
        "role": "member",
        "memberships": [{"tenant": "acme", "role": "member"}],
    }


def test_revoked_keys_stop_working_at_once(world, api):
    key_id = ApiKey.objects.get(user__username="acme-viewer").pk
    assert api.delete(f"/api/v1/api-keys/{key_id}", **bearer(world.keys["acme-admin"])).status_code == 204
    response = api.get("/api/v1/me", **bearer(world.keys["acme-viewer"]))
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "authentication_failed"


def test_members_see_and_revoke_only_their_own_keys(world, api):
    admin_key_id = ApiKey.objects.get(user__username="acme-admin").pk
    listed = api.get("/api/v1/api-keys", **bearer(world.keys["acme-member"])).json()["results"]
    assert {k["username"] for k in listed} == {"acme-member"}
    assert api.delete(f"/api/v1/api-keys/{admin_key_id}", **bearer(world.keys["acme-member"])).status_code == 404
    admin_listed = api.get("/api/v1/api-keys", **bearer(world.keys["acme-admin"])).json()["results"]
    assert {k["username"] for k in admin_listed} == {"acme-admin", "acme-member", "acme-viewer"}


def test_expired_keys_are_refused(world, api):
    body = api.post(
        "/api/v1/api-keys",
        {"name": "short", "expires_at": (utcnow() + timedelta(hours=1)).isoformat()},
        format="json",
        **bearer(world.keys["acme-member"]),
    ).json()
    assert api.get("/api/v1/me", **bearer(body["key"])).status_code == 200
    with time_machine.travel(utcnow() + timedelta(hours=2)):
        assert api.get("/api/v1/me", **bearer(body["key"])).status_code == 401


def test_last_used_is_recorded_without_a_write_per_request(world, api, django_assert_max_num_queries):
    key = world.keys["acme-viewer"]
    api.get("/api/v1/me", **bearer(key))
    first = ApiKey.objects.get(user__username="acme-viewer").last_used_at
    assert first is not None
    api.get("/api/v1/me", **bearer(key))
    assert ApiKey.objects.get(user__username="acme-viewer").last_used_at == first
    with time_machine.travel(utcnow() + timedelta(minutes=5)):
        api.get("/api/v1/me", **bearer(key))
    assert ApiKey.objects.get(user__username="acme-viewer").last_used_at > first


def test_a_key_never_outranks_its_member(world, api):
    # The key was issued as admin; the member is demoted; the key acts as member.
    headers = bearer(world.operator_key)
    api.patch("/api/v1/tenants/acme/members/acme-member", {"role": "admin"}, format="json", **headers)
    admin_key = api.post(
        "/api/v1/api-keys", {"name": "strong", "role": "admin"}, format="json", **bearer(world.keys["acme-admin"])
    ).json()
    promoted = api.post(
        "/api/v1/api-keys",
        {"name": "m", "tenant": "acme", "username": "acme-member", "role": "admin"},
        format="json",
        **headers,
    ).json()["key"]
    api.patch("/api/v1/tenants/acme/members/acme-member", {"role": "viewer"}, format="json", **headers)
    assert api.get("/api/v1/me", **bearer(promoted)).json()["role"] == "viewer"
    response = api.post("/api/v1/tenants/acme/members", {"username": "x1"}, format="json", **bearer(promoted))
    assert response.status_code == 403
    assert admin_key["role"] == "admin"


def test_platform_keys_act_as_operators(world, api):
    body = api.post(
        "/api/v1/api-keys", {"name": "automation", "scope": "platform"}, format="json", **bearer(world.operator_key)
    ).json()
    assert body["key"].startswith("sk-admin-") and body["tenant"] is None
    assert api.get("/api/v1/me", **bearer(body["key"])).json()["kind"] == "operator"


def test_a_demoted_operator_loses_platform_keys(world, api):
    world.operator.is_staff = False
    world.operator.save()
    assert api.get("/api/v1/me", **bearer(world.operator_key)).status_code == 401


def test_session_users_pick_their_tenant(world, api):
    api.post(
        "/api/v1/tenants/beta/members",
        {"username": "acme-viewer", "role": "admin"},
        format="json",
        **bearer(world.operator_key),
    )
    api.force_login(world.users["acme-viewer"])
    assert api.get("/api/v1/me").json()["tenant"] == "acme"  # alphabetical default
    assert api.get("/api/v1/me", **tenant_header("beta")).json()["role"] == "admin"
    response = api.get("/api/v1/me", **tenant_header("gamma"))
    assert response.status_code == 403


def test_a_signed_in_user_without_a_tenant_can_do_nothing(world, api):
    api.force_login(User.objects.create_user("loner", password="x"))
    assert api.get("/api/v1/tenants").status_code == 403


def test_a_limited_key_cannot_mint_a_stronger_one(world, api):
    # An admin's viewer-limited key (say, for a dashboard) must not issue an admin key.
    viewer_key = api.post(
        "/api/v1/api-keys", {"name": "dash", "role": "viewer"}, format="json", **bearer(world.keys["acme-admin"])
    ).json()["key"]
    response = api.post("/api/v1/api-keys", {"name": "escalate", "role": "admin"}, format="json", **bearer(viewer_key))
    assert response.status_code == 400
    assert "at most viewer" in response.json()["error"]["fields"]["role"][0]
    defaulted = api.post("/api/v1/api-keys", {"name": "same"}, format="json", **bearer(viewer_key)).json()
    assert defaulted["role"] == "viewer"
