"""The endpoint keys' management API: shown once and stored hashed, strict bodies that
write nothing when refused, scoping (another tenant's key is 404), who may change what,
rotation with a grace period, revocation; an endpoint key cannot call the management API;
a key's limits bounded by the tenant's and the platform's per-key maximum."""

from datetime import timedelta

import pytest
import time_machine

from apps.core.clock import utcnow
from apps.core.principals import Principal, PrincipalKind
from apps.gateway import keys
from apps.gateway.models import EndpointKey
from apps.gateway.services import set_tenant_limits
from apps.inference.models import Model
from tests.headers import bearer

pytestmark = pytest.mark.django_db

URL = "/api/v1/gateway/keys"


def post(api, key, body, url=URL):
    return api.post(url, body, format="json", **bearer(key))


@pytest.fixture
def models(world):
    return [
        Model.objects.create(tenant=world.tenants["acme"], name=name, source_kind="path", source="/m", format="gguf")
        for name in ("qwen", "llama")
    ]


def test_a_member_creates_a_key_shown_once_and_stored_hashed(api, world, models):
    response = post(api, world.keys["acme-member"], {"name": "app", "allowed_models": ["qwen"], "rpm_limit": 60})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["key"].startswith("sk-hf-") and body["display_prefix"] == body["key"][:14]
    assert body["tenant"] == "acme" and body["allowed_models"] == ["qwen"] and body["rpm_limit"] == 60
    assert response["Cache-Control"] == "no-store"
    row = EndpointKey.objects.get(pk=body["id"])
    assert row.key_hash == keys.hash_key(body["key"]) and body["key"] not in str(row.__dict__)
    listed = api.get(URL, **bearer(world.keys["acme-viewer"])).json()
    assert [k["id"] for k in listed["results"]] == [body["id"]] and "key" not in listed["results"][0]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"name": "x", "colour": "red"}, "colour"),
        ({}, "name"),
        ({"name": "x", "rpm_limit": 0}, "rpm_limit"),
        ({"name": "x", "allowed_models": ["nope"]}, "allowed_models"),
        ({"name": "x", "allowed_models": "qwen"}, "allowed_models"),
        ({"name": "x", "expires_at": "2000-01-01T00:00:00Z"}, "expires_at"),
    ],
)
def test_bad_bodies_are_refused_and_write_nothing(api, world, models, body, field):
    response = post(api, world.keys["acme-admin"], body)
    assert response.status_code == 400, response.json()
    assert field in response.json()["error"]["fields"]
    assert not EndpointKey.objects.exists()


def test_viewers_cannot_create_change_rotate_or_revoke(api, world, models):
    viewer = world.keys["acme-viewer"]
    assert post(api, viewer, {"name": "x"}).status_code == 403
    made = post(api, world.keys["acme-member"], {"name": "x"}).json()
    detail = f"{URL}/{made['id']}"
    assert api.patch(detail, {"rpm_limit": 5}, format="json", **bearer(viewer)).status_code == 403
    assert post(api, viewer, {}, url=f"{detail}/rotate").status_code == 403
    assert api.delete(detail, **bearer(viewer)).status_code == 403
    assert EndpointKey.objects.get().revoked_at is None


def test_another_tenants_key_is_not_found(api, world, models):
    made = post(api, world.keys["acme-member"], {"name": "x"}).json()
    other = world.keys["beta-admin"]
    detail = f"{URL}/{made['id']}"
    assert api.get(detail, **bearer(other)).status_code == 404
    assert api.patch(detail, {"rpm_limit": 5}, format="json", **bearer(other)).status_code == 404
    assert post(api, other, {}, url=f"{detail}/rotate").status_code == 404
    assert api.delete(detail, **bearer(other)).status_code == 404
    assert api.get(URL, **bearer(other)).json()["count"] == 0


def test_operators_name_the_tenant(api, world, models):
    response = post(api, world.operator_key, {"name": "x"})
    assert response.status_code == 400 and "tenant" in response.json()["error"]["fields"]
    response = post(api, world.operator_key, {"name": "x", "tenant": "beta"})
    assert response.status_code == 201 and response.json()["tenant"] == "beta"
    assert post(api, world.keys["acme-admin"], {"name": "x", "tenant": "beta"}).status_code == 404


def test_patch_changes_limits_and_models(api, world, models):
    made = post(api, world.keys["acme-member"], {"name": "x"}).json()
    response = api.patch(
        f"{URL}/{made['id']}",
        {"allowed_models": ["llama", "llama"], "concurrency_limit": 2, "tpm_limit": None},
        format="json",
        **bearer(world.keys["acme-member"]),
    )
    assert response.status_code == 200, response.json()
    assert response.json()["allowed_models"] == ["llama"] and response.json()["concurrency_limit"] == 2
    bad = api.patch(f"{URL}/{made['id']}", {"key_hash": "x"}, format="json", **bearer(world.keys["acme-member"]))
    assert bad.status_code == 400


def test_rotation_keeps_the_old_secret_for_the_grace_period(api, world, models):
    made = post(api, world.keys["acme-member"], {"name": "x"}).json()
    response = post(api, world.keys["acme-member"], {"grace_seconds": 60}, url=f"{URL}/{made['id']}/rotate")
    assert response.status_code == 200, response.json()
    rotated = response.json()
    assert rotated["key"] != made["key"] and rotated["previous_display_prefix"] == made["display_prefix"]
    row = EndpointKey.objects.get()
    assert row.key_hash == keys.hash_key(rotated["key"]) and row.previous_key_hash == keys.hash_key(made["key"])
    assert row.previous_valid_until - utcnow() <= timedelta(seconds=60)
    # a second rotation: the first secret stops at once, the second gets the grace
    again = post(api, world.keys["acme-member"], {"grace_seconds": 0}, url=f"{URL}/{made['id']}/rotate").json()
    row.refresh_from_db()
    assert row.key_hash == keys.hash_key(again["key"]) and row.previous_key_hash is None


def test_revoke_is_idempotent_and_a_revoked_key_is_not_rotated(api, world, models):
    made = post(api, world.keys["acme-member"], {"name": "x"}).json()
    detail = f"{URL}/{made['id']}"
    assert api.delete(detail, **bearer(world.keys["acme-member"])).status_code == 204
    assert api.delete(detail, **bearer(world.keys["acme-member"])).status_code == 204
    assert api.get(detail, **bearer(world.keys["acme-member"])).json()["active"] is False
    assert post(api, world.keys["acme-member"], {}, url=f"{detail}/rotate").status_code == 400


def test_an_endpoint_key_cannot_call_the_management_api(api, world, models):
    made = post(api, world.keys["acme-member"], {"name": "x"}).json()
    response = api.get(URL, **bearer(made["key"]))
    assert response.status_code == 401
    assert "/v1/" in response.json()["error"]["message"]
    assert api.get("/api/v1/tasks", **bearer(made["key"])).status_code == 401


def test_expired_keys_read_inactive(api, world, models):
    made = post(
        api, world.keys["acme-member"], {"name": "x", "expires_at": (utcnow() + timedelta(hours=1)).isoformat()}
    )
    with time_machine.travel(utcnow() + timedelta(hours=2)):
        assert api.get(f"{URL}/{made.json()['id']}", **bearer(world.keys["acme-member"])).json()["active"] is False


@pytest.fixture
def operator(world):
    return Principal(PrincipalKind.OPERATOR, user=world.operator)


def test_a_keys_limits_may_not_exceed_the_tenants(api, world, models, operator):
    set_tenant_limits(operator, world.tenants["acme"], rpm_limit=100, concurrency_limit=4)
    admin = world.keys["acme-admin"]
    response = post(api, admin, {"name": "x", "rpm_limit": 101, "concurrency_limit": 5})
    assert response.status_code == 400, response.json()
    fields = response.json()["error"]["fields"]
    assert fields["rpm_limit"] == [
        "At most 100: the tenant's limit of requests per minute, set by the platform's operators. "
        "Leave it empty for the tenant's limit."
    ]
    assert "At most 4" in fields["concurrency_limit"][0] and "tpm_limit" not in fields
    operator_asks = post(api, world.operator_key, {"name": "x", "tenant": "acme", "rpm_limit": 500})
    assert operator_asks.status_code == 400  # the bound is the operator's own: it holds for them too
    assert not EndpointKey.objects.exists()
    at_the_limit = post(api, admin, {"name": "x", "rpm_limit": 100, "tpm_limit": 10**9})  # no tenant tpm limit
    assert at_the_limit.status_code == 201, at_the_limit.json()
    empty = post(api, admin, {"name": "y"})  # empty: the tenant's limits
    assert empty.status_code == 201 and empty.json()["rpm_limit"] is None


def test_a_change_above_the_tenants_limit_writes_nothing_and_a_lowered_limit_leaves_keys_editable(
    api, world, models, operator
):
    admin = world.keys["acme-admin"]
    made = post(api, admin, {"name": "x", "rpm_limit": 100, "tpm_limit": 5000}).json()
    detail = f"{URL}/{made['id']}"
    set_tenant_limits(operator, world.tenants["acme"], rpm_limit=10, tpm_limit=1000)  # lowered below the key's
    refused = api.patch(detail, {"name": "renamed", "rpm_limit": 50}, format="json", **bearer(admin))
    assert refused.status_code == 400 and set(refused.json()["error"]["fields"]) == {"rpm_limit"}
    row = EndpointKey.objects.get()
    assert (row.name, row.rpm_limit, row.tpm_limit) == ("x", 100, 5000)
    renamed = api.patch(detail, {"name": "renamed"}, format="json", **bearer(admin))  # its limits untouched
    assert renamed.status_code == 200 and renamed.json()["rpm_limit"] == 100
    lowered = api.patch(detail, {"rpm_limit": 10, "tpm_limit": None}, format="json", **bearer(admin))
    assert lowered.status_code == 200 and (lowered.json()["rpm_limit"], lowered.json()["tpm_limit"]) == (10, None)


def test_the_platforms_largest_per_key_limits_bound_every_key(api, world, models, operator, settings):
    settings.HETEROFLOW_GATEWAY_KEY_MAX_TPM = 1000
    admin = world.keys["acme-admin"]
    response = post(api, admin, {"name": "x", "tpm_limit": 1001})
    assert response.status_code == 400
    assert response.json()["error"]["fields"]["tpm_limit"] == [
        "At most 1000: the platform's largest tokens per minute per key (HETEROFLOW_GATEWAY_KEY_MAX_TPM). "
        "Leave it empty for the maximum."
    ]
    set_tenant_limits(operator, world.tenants["acme"], tpm_limit=500)  # the smaller bound is named
    assert (
        "At most 500: the tenant's"
        in post(api, admin, {"name": "x", "tpm_limit": 800}).json()["error"]["fields"]["tpm_limit"][0]
    )
    set_tenant_limits(operator, world.tenants["acme"], tpm_limit=5000)
    assert (
        "At most 1000: the platform's"
        in post(api, admin, {"name": "x", "tpm_limit": 2000}).json()["error"]["fields"]["tpm_limit"][0]
    )
    assert not EndpointKey.objects.exists()
    assert post(api, admin, {"name": "x", "tpm_limit": 1000}).status_code == 201
