"""GET /api/v1/gateway/usage: the caller's buckets, scoped (another tenant's are not
there), filtered, paged, with totals per key and model; strict query parameters."""

from datetime import UTC, datetime, timedelta

import pytest

from apps.gateway.models import EndpointKey, UsageBucket
from tests.headers import bearer

pytestmark = pytest.mark.django_db

URL = "/api/v1/gateway/usage"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def usage(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    k1 = EndpointKey.objects.create(tenant=acme, name="k1", key_hash="1" * 64, display_prefix="sk-hf-1")
    k2 = EndpointKey.objects.create(tenant=acme, name="k2", key_hash="2" * 64, display_prefix="sk-hf-2")
    kb = EndpointKey.objects.create(tenant=beta, name="kb", key_hash="3" * 64, display_prefix="sk-hf-3")
    for i in range(3):
        UsageBucket.objects.create(
            tenant=acme,
            key=k1,
            model="qwen",
            service_id=7,
            minute=T0 + timedelta(minutes=i),
            requests=2,
            errors=1,
            prompt_tokens=10,
            completion_tokens=5,
            gpu_seconds=1.25,
        )
    UsageBucket.objects.create(tenant=acme, key=k2, model="llama", minute=T0, requests=1, prompt_tokens=3)
    UsageBucket.objects.create(tenant=beta, key=kb, model="qwen", minute=T0, requests=9)
    return k1, k2, kb


def test_a_tenant_reads_its_usage_with_totals(api, world, usage):
    body = api.get(URL, **bearer(world.keys["acme-viewer"])).json()
    assert body["count"] == 4 and {row["tenant"] for row in body["results"]} == {"acme"}
    totals = {(t["key_name"], t["model"]): t for t in body["totals"]}
    assert (totals[("k1", "qwen")]["requests"], totals[("k1", "qwen")]["completion_tokens"]) == (6, 15)
    assert totals[("k1", "qwen")]["minutes"] == 3 and totals[("k2", "llama")]["prompt_tokens"] == 3
    assert totals[("k1", "qwen")]["gpu_seconds"] == 3.75 and totals[("k2", "llama")]["gpu_seconds"] == 0.0
    assert {row["gpu_seconds"] for row in body["results"] if row["model"] == "qwen"} == {1.25}


def test_filters_and_paging(api, world, usage):
    k1, _, kb = usage
    key = world.keys["acme-member"]
    assert api.get(f"{URL}?key={k1.pk}", **bearer(key)).json()["count"] == 3
    assert api.get(f"{URL}?model=llama", **bearer(key)).json()["count"] == 1
    assert api.get(f"{URL}?service=7", **bearer(key)).json()["count"] == 3
    since = (T0 + timedelta(minutes=1)).isoformat().replace("+00:00", "Z")
    assert api.get(f"{URL}?since={since}", **bearer(key)).json()["count"] == 2
    page = api.get(f"{URL}?limit=1&offset=1", **bearer(key)).json()
    assert len(page["results"]) == 1 and page["results"][0]["minute"].startswith("2026-12-01T12:01")
    assert api.get(f"{URL}?key={kb.pk}", **bearer(key)).json()["count"] == 0  # another tenant's key: nothing
    assert api.get(f"{URL}?colour=red", **bearer(key)).status_code == 400
    assert api.get(f"{URL}?since=yesterday", **bearer(key)).status_code == 400


def test_operators_see_every_tenant(api, world, usage):
    assert api.get(URL, **bearer(world.operator_key)).json()["count"] == 5
