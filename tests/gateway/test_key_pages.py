"""The portal's endpoint keys page: create (the secret shown once), the API's words on a
bad form with nothing written (a limit above the tenant's included), rotate, revoke,
scoping, viewers only look; the usage page."""

from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.gateway import keys
from apps.gateway.models import EndpointKey, TenantLimits, UsageBucket
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db

URL = "/portal/endpoint-keys/"


def test_a_member_creates_rotates_and_revokes_a_key(client, world):
    signed_in(client, world.users["acme-member"])
    assert "No endpoint keys." in page(client, URL)
    response = client.post(URL, {"name": "app", "rpm_limit": "30"})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    row = EndpointKey.objects.get()
    html = response.content.decode()
    secret = html.split("data-new-key>", 1)[1].split("<", 1)[0]
    assert secret.startswith("sk-hf-") and row.key_hash == keys.hash_key(secret) and row.rpm_limit == 30
    assert secret not in page(client, URL)  # shown once
    response = client.post(f"{URL}{row.pk}/rotate/", {"grace_seconds": "120"})
    assert response.status_code == 200
    rotated = response.content.decode().split("data-new-key>", 1)[1].split("<", 1)[0]
    row.refresh_from_db()
    assert row.key_hash == keys.hash_key(rotated) and row.previous_key_hash == keys.hash_key(secret)
    assert client.post(f"{URL}{row.pk}/revoke/").status_code == 200
    row.refresh_from_db()
    assert row.revoked_at is not None


def test_a_bad_form_says_why_and_writes_nothing(client, world):
    signed_in(client, world.users["acme-member"])
    response = client.post(URL, {"name": "", "rpm_limit": "0", "allowed_models": "nope"})
    assert response.status_code == 400
    assert not EndpointKey.objects.exists()


def test_a_limit_above_the_tenants_is_the_fields_error_and_writes_nothing(client, world):
    TenantLimits.objects.create(tenant=world.tenants["acme"], concurrency_limit=3)
    signed_in(client, world.users["acme-member"])
    response = client.post(URL, {"name": "app", "concurrency_limit": "4"})
    assert response.status_code == 400
    assert "At most 3: the tenant&#x27;s limit of concurrent requests" in response.content.decode()
    assert not EndpointKey.objects.exists()


def test_viewers_see_no_form_and_cannot_revoke(client, world):
    signed_in(client, world.users["acme-member"])
    client.post(URL, {"name": "app"})
    row = EndpointKey.objects.get()
    signed_in(client, world.users["acme-viewer"])
    html = page(client, URL)
    assert "endpoint-key-form" not in html and "app" in html
    assert client.post(f"{URL}{row.pk}/revoke/").status_code == 403
    signed_in(client, world.users["beta-admin"])
    assert "No endpoint keys." in page(client, URL)
    assert client.post(f"{URL}{row.pk}/revoke/").status_code == 404
    row.refresh_from_db()
    assert row.revoked_at is None


def test_the_usage_page_shows_the_tenants_usage_only(client, world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    mine = EndpointKey.objects.create(tenant=acme, name="mine", key_hash="a" * 64, display_prefix="sk-hf-a")
    theirs = EndpointKey.objects.create(tenant=beta, name="theirs", key_hash="b" * 64, display_prefix="sk-hf-b")
    now = utcnow().replace(second=0, microsecond=0)
    UsageBucket.objects.create(
        tenant=acme, key=mine, model="qwen", minute=now, requests=4, completion_tokens=9, gpu_seconds=2.5
    )
    UsageBucket.objects.create(tenant=acme, key=mine, model="qwen", minute=now - timedelta(minutes=1), requests=2)
    UsageBucket.objects.create(tenant=beta, key=theirs, model="qwen", minute=now, requests=7)
    signed_in(client, world.users["acme-viewer"])
    html = page(client, "/portal/gateway-usage/")
    assert 'data-usage="mine/qwen"' in html and "theirs" not in html
    assert html.count("data-minute=") == 2 and "Peak 4 requests" in html
    assert "<td data-gpu-seconds>2.50</td>" in html and "2.50 GPU-seconds" in html
