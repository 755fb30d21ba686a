"""Limits through the route: requests, tokens and concurrent requests per key and per
tenant, 429 with Retry-After at the window's reset, held across two gateway processes
(two route instances with their own caches and pools, one Redis); the smaller of a key's
and its tenant's limit holds (an operator lowering the tenant's below the key's), and
the platform's per-key maximum; a sleeping service is asked to wake, and a request waits
for it when the setting says so."""

import threading
import time

import httpx
import openai
import pytest
import redis
from django.conf import settings as django_settings
from django.core.asgi import get_asgi_application
from django.db import connection

from apps.core.principals import Principal, PrincipalKind
from apps.gateway import limits
from apps.gateway.api import route
from apps.gateway.api.route import GatewayApp
from apps.gateway.services import set_tenant_limits
from tests.factories import OperatorFactory, make_task
from tests.gateway.upstream import Served
from tests.live import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def chat(url, key, **extra):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10).chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": "hi"}], **extra
    )


@pytest.fixture(scope="module")
def second():
    """Another gateway process's worth: its own route, catalog, pools and caches."""
    app = GatewayApp(get_asgi_application())
    served = Served(app)
    yield served
    served.call(app.close())
    served.stop()


@pytest.mark.usefixtures("one_minute")
def test_requests_per_minute_per_key_hold_across_processes(gateway, second, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key(rpm_limit=4)
    _, other = tenancy.key(name="other")
    for url in (gateway.url, second.url, gateway.url, second.url):
        chat(url, key)
    with pytest.raises(openai.RateLimitError) as caught:
        chat(second.url, key)
    response = caught.value.response
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert caught.value.code == "rate_limit_exceeded" and "requests per minute" in caught.value.message
    assert chat(gateway.url, other).choices  # another key of the tenant is not limited by it
    assert len(upstreams["a"].app.requests) == 5


@pytest.mark.usefixtures("one_minute")
def test_a_tenants_limit_covers_all_its_keys(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    operator = Principal(PrincipalKind.OPERATOR, user=OperatorFactory(username="gw-limits-op"))
    set_tenant_limits(operator, tenancy.tenant, rpm_limit=3)
    keys = [tenancy.key(name=f"k{i}")[1] for i in range(3)]
    for key in keys:
        chat(gateway.url, key)
    with pytest.raises(openai.RateLimitError, match="this tenant"):
        chat(gateway.url, keys[0])


@pytest.mark.usefixtures("one_minute")
def test_a_tenant_limit_lowered_below_a_keys_holds_at_once(gateway, upstreams, tenancy):
    """The key was set to 10 requests a minute; the operator then gives the tenant 2: the
    key's own row is not changed, admission takes the smaller."""
    tenancy.service("qwen", [upstreams["a"]])
    row, key = tenancy.key(rpm_limit=10)
    chat(gateway.url, key)  # the key is cached with no tenant limit
    operator = Principal(PrincipalKind.OPERATOR, user=OperatorFactory(username="gw-lowering-op"))
    set_tenant_limits(operator, tenancy.tenant, rpm_limit=2)
    for _ in range(2):
        chat(gateway.url, key)
    with pytest.raises(openai.RateLimitError, match="this tenant"):
        chat(gateway.url, key)
    row.refresh_from_db()
    assert row.rpm_limit == 10 and len(upstreams["a"].app.requests) == 3


@pytest.mark.usefixtures("one_minute")
def test_the_platforms_per_key_maximum_holds_keys_with_no_limit_or_one_set_before(
    gateway, upstreams, tenancy, settings
):
    tenancy.service("qwen", [upstreams["a"]])
    _, set_before = tenancy.key(name="before", rpm_limit=50)
    settings.HETEROFLOW_GATEWAY_KEY_MAX_RPM = 2
    _, unlimited = tenancy.key(name="none")
    for key in (set_before, unlimited):
        chat(gateway.url, key)
        chat(gateway.url, key)
        with pytest.raises(openai.RateLimitError, match="this API key"):
            chat(gateway.url, key)


@pytest.mark.usefixtures("one_minute")
def test_tokens_per_minute_refuse_once_the_minutes_tokens_reached_the_limit(gateway, upstreams, tenancy):
    service = tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key(tpm_limit=15)  # the stand-in's answer uses 10 tokens
    store = redis.Redis.from_url(django_settings.REDIS_URL)

    def ended():  # a request's tokens are counted when it ends, on the gateway's side, after the answer
        wait_until(lambda: int(store.get(limits.inflight_key(service.pk)) or 0) == 0, 5, "the request's end")

    chat(gateway.url, key)
    ended()
    chat(gateway.url, key)
    ended()
    with pytest.raises(openai.RateLimitError, match="tokens per minute"):
        chat(gateway.url, key)


def test_concurrent_requests_per_key_and_the_count_goes_back(gateway, second, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    row, key = tenancy.key(concurrency_limit=2)
    streams = [
        chat(url, key, stream=True, max_tokens=10, extra_body={"standin": {"delay": 0.1}})
        for url in (gateway.url, second.url)
    ]
    for stream in streams:
        next(iter(stream))
    with pytest.raises(openai.RateLimitError, match="concurrent") as caught:
        chat(gateway.url, key)
    assert caught.value.response.headers["retry-after"] == "1"
    for stream in streams:
        list(stream)
    store = redis.Redis.from_url(django_settings.REDIS_URL)
    wait_until(lambda: store.zcard(f"hf:gw:conc:k:{row.pk}") == 0, 5, "the key's concurrency count to go back")
    assert chat(gateway.url, key).choices


@pytest.mark.usefixtures("one_minute")
def test_a_refused_request_counts_nothing(gateway, upstreams, tenancy):
    service = tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key(rpm_limit=1)
    chat(gateway.url, key)
    for _ in range(3):
        with pytest.raises(openai.RateLimitError):
            chat(gateway.url, key)
    store = redis.Redis.from_url(django_settings.REDIS_URL)
    assert int(store.get(limits.inflight_key(service.pk)) or 0) == 0


def test_retry_after_is_the_windows_reset():
    assert limits.retry_after("requests", 120.0) == 60
    assert limits.retry_after("tokens", 179.5) == 1
    assert limits.retry_after("requests", 150.2) == 30
    assert limits.retry_after("concurrency", 150.2) == 1


def test_a_sleeping_service_is_asked_to_wake_and_answers_503(gateway, upstreams, tenancy, monkeypatch):
    service = tenancy.service("qwen", [], state="sleeping")
    _, key = tenancy.key()
    asked = []
    monkeypatch.setattr(route, "ask_for_wake", asked.append)
    for _ in range(2):
        response = httpx.post(
            f"{gateway.url}/v1/chat/completions", json={"model": "qwen"}, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 503 and "retry-after" in response.headers
    wait_until(lambda: asked, 5, "the wake to be asked for")
    assert asked == [service.pk]  # once per few seconds per process, however many requests


def test_a_request_waits_for_a_waking_service_when_the_setting_says(gateway, upstreams, tenancy, settings, monkeypatch):
    settings.HETEROFLOW_GATEWAY_WAKE_WAIT_SECONDS = 5
    service = tenancy.service("qwen", [], state="sleeping")
    _, key = tenancy.key()
    monkeypatch.setattr(route, "ask_for_wake", lambda service_id: None)

    def wakes():
        time.sleep(0.8)
        task = make_task(
            tenancy.tenant,
            name="woken",
            group=service.group,
            rank=0,
            kind="inference",
            status="running",
            node=tenancy.node,
            host_port=upstreams["b"].port,
            gpu_required=1,
        )
        tenancy.node.task_health = [{"task_id": task.id, "healthy": True}]
        tenancy.node.save(update_fields=["task_health"])
        connection.close()

    thread = threading.Thread(target=wakes)
    thread.start()
    try:
        assert chat(gateway.url, key).system_fingerprint == "b"
    finally:
        thread.join()
