"""The OpenAI-compatible endpoints through the official `openai` client (sync and async,
streaming and not) against the gateway's route in front of stand-in upstreams
registered as an inference service's replicas: bodies pass through unchanged, errors
are OpenAI's with the right statuses, keys (bad, tenant, revoked, rotated, expired,
restricted), retry on a refused connection, a backend dying mid-stream, a client leaving
mid-stream, usage and the services' signals."""

import asyncio
import time

import httpx
import openai
import psycopg
import pytest
import redis
from django.conf import settings as django_settings

from apps.gateway import services as gateway_services
from apps.gateway.models import EndpointKey, UsageBucket
from apps.inference.models import InferenceService
from apps.monitoring import metrics
from tests.gateway.upstream import Served, Upstream, free_port

pytestmark = pytest.mark.django_db(transaction=True)


def client(gateway, key, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=10, **options)


def chat(gateway, key, model="qwen", **extra):
    return client(gateway, key).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], **extra
    )


def test_chat_completions_embeddings_and_models(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key()
    openai_client = client(gateway, key)
    answer = openai_client.chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": "hi"}], user="u1"
    )
    assert answer.choices[0].message.content == "hello from a" and answer.usage.total_tokens == 10
    path, body, headers = upstreams["a"].app.requests[-1]
    assert path == "/v1/chat/completions"
    assert body == {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "user": "u1"}
    assert "authorization" not in headers  # the endpoint key stays here
    text = openai_client.completions.create(model="qwen", prompt="once upon")
    assert text.choices[0].text == "hello from a"
    vectors = openai_client.embeddings.create(model="qwen", input=["a", "b"])
    assert [v.embedding for v in vectors.data] == [[0.1, 0.2, 0.3]] * 2
    assert [m.id for m in openai_client.models.list()] == ["qwen"]
    assert openai_client.models.retrieve("qwen").owned_by == tenancy.tenant.slug


def test_streaming_chat_passes_chunk_by_chunk(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key()
    stream = chat(gateway, key, stream=True, max_tokens=4, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == "tok " * 4
    assert chunks[-1].usage.completion_tokens == 4


def test_the_async_client_streams_and_not(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key()

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0) as aclient:
            whole = await aclient.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "x"}])
            stream = await aclient.completions.create(model="qwen", prompt="x", stream=True, max_tokens=2)
            parts = [c.choices[0].text async for c in stream]
            together = await asyncio.gather(*(aclient.embeddings.create(model="qwen", input="x") for _ in range(20)))
            return whole, parts, together

    whole, parts, together = asyncio.run(go())
    assert whole.choices[0].message.content == "hello from a" and parts == ["tok ", "tok "]
    assert len(together) == 20


def test_first_byte_comes_before_the_stream_ends(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key()
    started = time.monotonic()
    stream = chat(gateway, key, stream=True, max_tokens=5, extra_body={"standin": {"delay": 0.3}})
    first = next(iter(stream))
    assert first.choices[0].delta.content == "tok " and time.monotonic() - started < 1.0
    assert len(list(stream)) == 4


@pytest.mark.parametrize(
    "key,status,code",
    [
        ("", 401, "missing_api_key"),
        ("sk-hf-not-a-key", 401, "invalid_api_key"),
        ("sk-other", 401, "invalid_api_key"),
    ],
)
def test_bad_keys_are_401(gateway, upstreams, tenancy, key, status, code):
    tenancy.service("qwen", [upstreams["a"]])
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "qwen"}, headers=headers)
    assert response.status_code == status and response.json()["error"]["code"] == code
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert not upstreams["a"].app.requests


def test_a_tenant_key_does_not_call_the_gateway(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    with pytest.raises(openai.AuthenticationError, match="endpoint key"):
        chat(gateway, tenancy.tenant_key)


def test_revoked_rotated_and_expired_keys(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    row, key = tenancy.key()
    assert chat(gateway, key).choices
    rotated = gateway_services.rotate_key(tenancy.principal, row, grace_seconds=60)
    assert chat(gateway, key).choices and chat(gateway, rotated.key).choices  # both, for the grace period
    EndpointKey.objects.filter(pk=row.pk).update(previous_valid_until="2000-01-01T00:00:00Z")
    gateway.app.catalog.clear()
    with pytest.raises(openai.AuthenticationError, match="rotated"):
        chat(gateway, key)
    assert chat(gateway, rotated.key).choices
    gateway_services.revoke_key(tenancy.principal, row)
    with pytest.raises(openai.AuthenticationError, match="revoked"):
        chat(gateway, rotated.key)
    other_row, other = tenancy.key(name="soon", expires_at="2999-01-01T00:00:00Z")
    EndpointKey.objects.filter(pk=other_row.pk).update(expires_at="2000-01-01T00:00:00Z")
    gateway.app.catalog.clear()
    with pytest.raises(openai.AuthenticationError, match="expired"):
        chat(gateway, other)


def test_unknown_model_is_404_and_a_model_not_allowed_403(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    tenancy.service("llama", [upstreams["b"]])
    _, key = tenancy.key(allowed_models=["qwen"])
    with pytest.raises(openai.NotFoundError) as caught:
        chat(gateway, key, model="gpt-9")
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.PermissionDeniedError):
        chat(gateway, key, model="llama")
    assert [m.id for m in client(gateway, key).models.list()] == ["qwen"]


def test_bad_bodies_are_400(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key()
    auth = {"Authorization": f"Bearer {key}"}
    for content in (b"not json", b"[1]", b'{"messages": []}', b'{"model": 3}'):
        response = httpx.post(f"{gateway.url}/v1/chat/completions", content=content, headers=auth)
        assert response.status_code == 400, content
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{gateway.url}/v1/chat/completions", headers=auth).status_code == 405
    assert not upstreams["a"].app.requests


def test_no_healthy_backend_is_503_and_a_sleeping_service_503_with_retry_after(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]], healthy=False)
    tenancy.service("llama", [], state="sleeping")
    _, key = tenancy.key()
    with pytest.raises(openai.InternalServerError) as caught:
        chat(gateway, key)
    assert caught.value.status_code == 503
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"model": "llama"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 503 and response.json()["error"]["code"] == "model_waking"
    assert int(response.headers["retry-after"]) == django_settings.HETEROFLOW_GATEWAY_WAKE_RETRY_AFTER_SECONDS


def test_a_refused_connection_is_retried_once_on_another_backend(gateway, upstreams, tenancy):
    dead = type("Dead", (), {"port": free_port()})()
    tenancy.service("qwen", [dead, upstreams["b"]])
    _, key = tenancy.key()
    answers = {chat(gateway, key, user=f"user-{i}").system_fingerprint for i in range(6)}
    assert answers == {"b"}
    assert f"http://127.0.0.1:{dead.port}" in gateway.app.catalog._quarantine


def test_only_dead_backends_answer_502(gateway, upstreams, tenancy):
    dead = type("Dead", (), {"port": free_port()})()
    tenancy.service("qwen", [dead])
    _, key = tenancy.key()
    with pytest.raises(openai.InternalServerError) as caught:
        chat(gateway, key)
    assert caught.value.status_code == 502


def test_a_service_asleep_behind_cached_routes_is_woken_not_502(gateway, tenancy):
    """The routes cached from before the service fell asleep still name its stopped
    replica: the refused connection makes the gateway read the routes again, and a
    sleeping service answers the waking 503 (with Retry-After), never a 502."""
    gone = Served(Upstream("gone"))
    service = tenancy.service("qwen", [gone])
    _, key = tenancy.key()
    assert chat(gateway, key).choices  # the routes are cached with the replica in them
    gone.stop()
    InferenceService.objects.filter(pk=service.pk).update(state="sleeping")  # no signal: the cache stays
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"model": "qwen"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 503 and response.json()["error"]["code"] == "model_waking"
    assert response.headers["retry-after"]


def test_a_service_asleep_whose_stopped_replica_the_prober_took_out_is_woken_not_503_no_backend(gateway, tenancy):
    """The prober may take the stopped replica out of rotation before any request comes:
    the cached routes then leave no usable backend and still say the service runs. The
    gateway reads them again and wakes the sleeping service (the waking 503)."""
    gone = Served(Upstream("gone"))
    service = tenancy.service("qwen", [gone])
    _, key = tenancy.key()
    assert chat(gateway, key).choices
    gone.stop()
    InferenceService.objects.filter(pk=service.pk).update(state="sleeping")  # no signal: the cache stays
    gateway.app.catalog.quarantine(f"http://127.0.0.1:{gone.port}")  # as the prober does
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"model": "qwen"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 503 and response.json()["error"]["code"] == "model_waking"


def test_a_backend_dying_mid_stream_is_an_error_and_the_next_request_goes_elsewhere(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key()
    stream = chat(gateway, key, stream=True, max_tokens=5, extra_body={"standin": {"die_after": 2}})
    with pytest.raises(openai.APIError, match="mid-stream"):
        list(stream)
    assert chat(gateway, key).choices  # and the gateway still serves


def test_a_client_leaving_mid_stream_cancels_the_upstream_and_counts_go_back(gateway, upstreams, tenancy):
    service = tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key()
    left = metrics.GATEWAY_REQUESTS.labels("chat", "disconnected")
    before = left._value.get()
    stream = chat(gateway, key, stream=True, max_tokens=50, extra_body={"standin": {"delay": 0.2}})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 5
    while upstreams["a"].app.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstreams["a"].app.active == 0 and upstreams["a"].app.cancelled == 1
    store = redis.Redis.from_url(django_settings.REDIS_URL)
    assert int(store.get(f"hf:svc:{service.pk}:inflight") or 0) == 0
    assert store.zcard(f"hf:gw:conns:http://127.0.0.1:{upstreams['a'].port}") == 0
    assert left._value.get() == before + 1


def test_usage_is_recorded_once_per_request_and_signals_are_written(gateway, upstreams, tenancy, settings):
    settings.HETEROFLOW_GATEWAY_FLUSH_SECONDS = 600  # the test flushes
    gateway.call(gateway.app.meter.flush())
    service = tenancy.service("qwen", [upstreams["a"]])
    row, key = tenancy.key()
    chat(gateway, key)
    list(chat(gateway, key, stream=True, max_tokens=4, stream_options={"include_usage": True}))
    list(chat(gateway, key, stream=True, max_tokens=2))  # no usage sent: one token per event
    deadline = time.monotonic() + 5  # the last request is counted once its stream has ended on the gateway too
    while sum(counts[0] for counts in gateway.app.meter.buckets.values()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    gateway.call(gateway.app.meter.flush())
    buckets = UsageBucket.objects.all()  # one, or two when the minute turned meanwhile
    assert {(b.key_id, b.model, b.service_id) for b in buckets} == {(row.pk, "qwen", service.pk)}
    totals = [sum(getattr(b, f) for b in buckets) for f in ("requests", "errors", "prompt_tokens", "completion_tokens")]
    assert totals == [3, 0, 12, 9]
    row.refresh_from_db()
    service.refresh_from_db()
    assert row.last_used_at is not None and service.last_request_at is not None
    store = redis.Redis.from_url(django_settings.REDIS_URL)
    minute = int(time.time() // 60)
    assert (
        int(store.get(f"hf:svc:{service.pk}:tokens:{minute}") or 0)
        + int(store.get(f"hf:svc:{service.pk}:tokens:{minute - 1}") or 0)
        == 9
    )
    assert InferenceService.objects.get(pk=service.pk).last_request_at is not None


def test_a_database_that_is_away_is_503_and_a_bug_500_in_openais_shape(gateway, upstreams, tenancy, monkeypatch):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key()

    async def away(*args, **kwargs):
        raise psycopg.OperationalError("connection refused")

    monkeypatch.setattr(gateway.app.catalog, "fetch", away)
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"model": "qwen"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 503 and response.json()["error"]["code"] == "catalog_unavailable"
    assert response.headers["retry-after"] == "5"

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(gateway.app.catalog, "fetch", broken)
    response = httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"


def test_a_replica_closing_its_idle_connection_is_no_error(gateway, upstreams, tenancy):
    """uvicorn (and llama.cpp) close an idle keep-alive connection after 5 s; the gateway's
    pool lets it go before, so the next request never lands on a closing connection."""
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key()
    assert chat(gateway, key).choices
    time.sleep(5.5)
    assert chat(gateway, key).choices
