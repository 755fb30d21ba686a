"""The admin's endpoint keys: an operator changing a key's limits there is bounded as
through the API (the tenant's limits, the platform's per-key maximum), on the limits
changed only."""

import pytest

from apps.gateway.models import EndpointKey, TenantLimits

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(client, world):
    client.force_login(world.operator)
    return client


def form(row: EndpointKey, **changes) -> dict:
    """The change form as the admin's page posts it back."""
    values = {
        "name": row.name,
        "allowed_models": "[]",
        "rpm_limit": row.rpm_limit or "",
        "tpm_limit": row.tpm_limit or "",
        "concurrency_limit": row.concurrency_limit or "",
        "expires_at_0": "",
        "expires_at_1": "",
        "revoked_at_0": "",
        "revoked_at_1": "",
    }
    return values | changes


def test_a_limit_above_the_tenants_is_refused_in_the_admin_and_other_changes_are_not(admin, world, settings):
    acme = world.tenants["acme"]
    row = EndpointKey.objects.create(tenant=acme, name="app", key_hash="a" * 64, display_prefix="sk-hf-a", rpm_limit=50)
    TenantLimits.objects.create(tenant=acme, rpm_limit=20)  # lowered below the key's since
    url = f"/admin/gateway/endpointkey/{row.pk}/change/"
    refused = admin.post(url, form(row, rpm_limit="30"))
    assert refused.status_code == 200 and "At most 20: the tenant&#x27;s limit" in refused.content.decode()
    settings.HETEROFLOW_GATEWAY_KEY_MAX_CONCURRENCY = 8
    refused = admin.post(url, form(row, concurrency_limit="9"))
    assert "HETEROFLOW_GATEWAY_KEY_MAX_CONCURRENCY" in refused.content.decode()
    row.refresh_from_db()
    assert (row.rpm_limit, row.concurrency_limit) == (50, None)
    renamed = admin.post(url, form(row, name="renamed"))  # its limits untouched: accepted
    assert renamed.status_code == 302
    row.refresh_from_db()
    assert (row.name, row.rpm_limit) == ("renamed", 50)
