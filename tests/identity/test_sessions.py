"""Session hygiene (apps.identity.session, docs/identity.md#sessions): the idle timeout
ends a session unused for too long; creating an API key asks for a recent sign-in (the
API's 403 with its code, the portal's page sends the person to sign in again and back);
keys themselves are never asked. And with HETEROFLOW_LOCAL_SIGN_IN off, local passwords
work only for break-glass operators, on the portal's form and the admin's."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.test import Client, override_settings

from apps.identity.models import DirectoryIdentity
from apps.tenants.models import ApiKey
from tests.headers import bearer

pytestmark = pytest.mark.django_db
PASSWORD = "pw-for-tests-only"  # every factory-made user's (tests/factories.py)


def signed_in(user, address="198.51.100.60"):
    client = Client(REMOTE_ADDR=address)
    response = client.post("/portal/login/", {"username": user.username, "password": PASSWORD})
    assert response.status_code == 302, response.content[:300]
    return client


@override_settings(HETEROFLOW_SESSION_IDLE_SECONDS=600)
def test_a_session_unused_for_the_idle_timeout_is_signed_out(world):
    with time_machine.travel("2026-12-01 09:00:00Z", tick=False) as clock:
        client = signed_in(world.users["acme-member"])
        clock.shift(timedelta(minutes=8))
        assert client.get("/portal/").status_code == 200  # used: the idle clock starts again
        clock.shift(timedelta(minutes=8))
        assert client.get("/api/v1/me").status_code == 200
        clock.shift(timedelta(minutes=11))
        response = client.get("/portal/tasks/")
        assert response.status_code == 302 and response["Location"].startswith("/portal/login/?next=/portal/tasks/")
        assert client.get("/api/v1/me").status_code in (401, 403)


@override_settings(HETEROFLOW_REAUTH_SECONDS=300)
def test_creating_a_key_asks_for_a_recent_sign_in_and_keys_are_not_asked(world):
    body = {"name": "laptop", "scope": "tenant", "role": "viewer"}
    with time_machine.travel("2026-12-01 09:00:00Z", tick=False) as clock:
        client = signed_in(world.users["acme-member"])
        assert client.post("/api/v1/api-keys", body, content_type="application/json").status_code == 201
        clock.shift(timedelta(minutes=6))
        refused = client.post("/api/v1/api-keys", body | {"name": "later"}, content_type="application/json")
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "reauthentication_required"
        assert not ApiKey.objects.filter(name="later").exists()

        page = client.post("/portal/keys/", {"name": "later", "role": "viewer"})
        assert page.status_code == 302 and page["Location"] == "/portal/login/?next=%2Fportal%2Fkeys%2F&reauth=1"
        again = client.get(page["Location"])
        assert again.status_code == 200 and b"Sign in again" in again.content  # not bounced back
        back = client.post(
            "/portal/login/",
            {"username": "acme-member", "password": PASSWORD, "next": "/portal/keys/", "reauth": "1"},
        )
        assert back.status_code == 302 and back["Location"] == "/portal/keys/"
        assert client.post("/portal/keys/", {"name": "later", "role": "viewer"}).status_code == 200
        assert ApiKey.objects.filter(name="later").exists()

        # a key creating a key is a machine's doing: never asked
        made = Client().post(
            "/api/v1/api-keys",
            body | {"name": "by-key"},
            content_type="application/json",
            **bearer(world.keys["acme-member"]),
        )
        assert made.status_code == 201


@override_settings(HETEROFLOW_LOCAL_SIGN_IN=False)
def test_with_local_sign_in_off_only_break_glass_operators_use_passwords(world):
    member = world.users["acme-member"]
    refused = Client(REMOTE_ADDR="198.51.100.61").post(
        "/portal/login/", {"username": member.username, "password": PASSWORD}
    )
    assert refused.status_code == 200 and b"did not match" in refused.content
    page = Client().get("/portal/login/")
    assert b'id="break-glass"' in page.content  # the form folded away

    assert signed_in(world.operator)  # a local operator: break-glass
    admin = Client(REMOTE_ADDR="198.51.100.62")
    admin.post("/admin/login/?next=/admin/", {"username": world.operator.username, "password": PASSWORD})
    assert "_auth_user_id" in admin.session

    # an operator account that signs in through a directory is not break-glass
    DirectoryIdentity.objects.create(user=world.operator, source="oidc:corp", subject="op")
    directory_admin = Client(REMOTE_ADDR="198.51.100.63")
    directory_admin.post("/admin/login/?next=/admin/", {"username": world.operator.username, "password": PASSWORD})
    assert "_auth_user_id" not in directory_admin.session


def test_the_admins_sign_in_page_is_the_portals(world):
    response = Client().get("/admin/login/?next=/admin/identity/groupmapping/")
    assert response.status_code == 302
    assert response["Location"] == "/portal/login/?next=%2Fadmin%2Fidentity%2Fgroupmapping%2F"


def test_several_providers_each_get_a_button_beside_the_form(world):
    def configured(label):
        return {
            "issuer": "http://127.0.0.1:9/",
            "client_id": "hf",
            "client_secret": "s",
            "label": label,
            "scopes": "openid groups",
            "groups_claim": "groups",
            "username_claim": "preferred_username",
        }

    providers = {"corp": configured("Corp SSO"), "lab": configured("Lab Keycloak")}
    with override_settings(HETEROFLOW_OIDC_PROVIDERS=providers):
        page = Client().get("/portal/login/?next=/portal/tasks/").content.decode()
        # an unreachable provider is a clear page, not a 500
        unreachable = Client().get("/identity/oidc/lab/")
    assert 'href="/identity/oidc/corp/?next=%2Fportal%2Ftasks%2F">Sign in with Corp SSO</a>' in page
    assert 'href="/identity/oidc/lab/?next=%2Fportal%2Ftasks%2F">Sign in with Lab Keycloak</a>' in page
    assert 'name="password"' in page  # the local form beside them
    assert unreachable.status_code == 502 and b"Lab Keycloak cannot be reached" in unreachable.content
