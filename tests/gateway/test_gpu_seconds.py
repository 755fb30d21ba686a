"""GPU-seconds in the gateway's usage, through the real route and a stand-in replica: a
request's share of its replica's cards for the time it held them, written in the usage
bucket. The replica's cards come from the GPU ledger (whole cards, a share of a card's
memory), or what the replica asked for where the ledger has no row; an external backend
has none. A request the client cancels counts until it left, one whose replica broke
until it broke, one whose connection was refused nothing."""

import asyncio
import time

import openai
import pytest

from apps.nodes.models import Gpu
from apps.scheduler.models import GpuAllocation
from apps.tasks.models import Task
from tests.gateway.metered import written
from tests.gateway.upstream import free_port

pytestmark = pytest.mark.django_db(transaction=True)

STREAM_EVENTS, EVENT_DELAY = 5, 0.2  # the stand-in streams 5 events 0.2 s apart: at least 1 s held


def client(gateway, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=20)


def stream(gateway, key, events=STREAM_EVENTS, **standin):
    return client(gateway, key).chat.completions.create(
        model="qwen",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        max_tokens=events,
        extra_body={"standin": {"delay": EVENT_DELAY, **standin}},
    )


def test_a_lone_request_counts_all_its_replicas_cards_for_its_time(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]], gpus=2)
    row, key = tenancy.key()
    started = time.monotonic()
    assert len(list(stream(gateway, key))) == STREAM_EVENTS
    elapsed = time.monotonic() - started
    usage = written(gateway, row, 1)
    assert usage.requests == 1 and usage.errors == 0
    assert 2 * STREAM_EVENTS * EVENT_DELAY <= usage.gpu_seconds <= 2 * elapsed


def test_requests_served_at_once_share_the_replicas_card(gateway, upstreams, tenancy):
    """Four streams at once on a one-card replica: together the card's time once (the
    time the replica was busy), not four times."""
    tenancy.service("qwen", [upstreams["a"]], gpus=1)
    row, key = tenancy.key()

    async def four():
        async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0) as aclient:

            async def one():
                answer = await aclient.chat.completions.create(
                    model="qwen",
                    messages=[{"role": "user", "content": "hi"}],
                    stream=True,
                    max_tokens=STREAM_EVENTS,
                    extra_body={"standin": {"delay": EVENT_DELAY}},
                )
                return [chunk async for chunk in answer]

            return await asyncio.gather(*(one() for _ in range(4)))

    started = time.monotonic()
    assert [len(chunks) for chunks in asyncio.run(four())] == [STREAM_EVENTS] * 4
    elapsed = time.monotonic() - started
    usage = written(gateway, row, 4)
    assert usage.requests == 4
    # each held the replica at least 1 s, all within `elapsed`: the card's busy time lies between
    assert STREAM_EVENTS * EVENT_DELAY <= usage.gpu_seconds <= elapsed
    assert usage.gpu_seconds < 4 * STREAM_EVENTS * EVENT_DELAY
    assert gateway.app.clocks.of(f"http://127.0.0.1:{upstreams['a'].port}").in_flight == 0


def test_a_request_the_client_cancels_counts_until_it_left(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]], gpus=1)
    row, key = tenancy.key()
    started = time.monotonic()
    answer = stream(gateway, key, events=100)  # 20 s if read to the end
    next(iter(answer))
    answer.close()
    usage = written(gateway, row, 1)
    held_at_most = time.monotonic() - started
    assert upstreams["a"].app.cancelled == 1
    assert usage.errors == 1 and 0 < usage.gpu_seconds <= held_at_most < 100 * EVENT_DELAY


def test_a_replica_that_breaks_counts_until_it_broke_and_a_refused_one_nothing(gateway, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]], gpus=1)
    dead = type("Dead", (), {"port": free_port()})()
    # a port an earlier test's dead backend had may still be in this gateway's quarantine
    # (then no backend is usable: 503, not the refused connection this test is about)
    gateway.app.catalog._quarantine.pop(f"http://127.0.0.1:{dead.port}", None)
    tenancy.service("llama", [dead], gpus=4)
    row, key = tenancy.key()
    with pytest.raises(openai.APIError, match="mid-stream"):
        list(stream(gateway, key, die_after=2))  # two events 0.2 s apart, then the connection drops
    usage = written(gateway, row, 1)
    assert usage.errors == 1 and usage.gpu_seconds >= 2 * EVENT_DELAY

    with pytest.raises(openai.InternalServerError) as caught:
        client(gateway, key).chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 502
    refused = written(gateway, row, 1, model="llama")
    assert (refused.requests, refused.errors, refused.gpu_seconds) == (1, 1, 0.0)
    assert gateway.app.clocks.of(f"http://127.0.0.1:{dead.port}").in_flight == 0


def test_the_replicas_cards_come_from_the_gpu_ledger(gateway, tenancy):
    ports = [type("Port", (), {"port": 9000 + i})() for i in range(4)]
    node = tenancy.node
    for index, memory in ((0, 81920), (1, 81920), (2, 81920), (3, None)):
        Gpu.objects.create(node=node, index=index, memory_total_mb=memory)
    service = tenancy.service("qwen", ports, gpus=2)
    whole, share, unknown_size, unbound = Task.objects.filter(group=service.group).order_by("rank")
    for task, index, memory in (
        (whole, 0, None),
        (whole, 1, None),
        (share, 2, 20480),  # a quarter of card 2
        (unknown_size, 3, 20480),  # a share of a card of unknown size: the whole card
    ):
        GpuAllocation.objects.create(task=task, node=node, gpu_index=index, tenant=tenancy.tenant, memory_mb=memory)
    memory_only = tenancy.service("mem", [type("Port", (), {"port": 9100})()])
    Task.objects.filter(group=memory_only.group).update(gpu_required=0, gpu_memory_mb=4096)
    cpu_only = tenancy.service("cpu", [type("Port", (), {"port": 9200})()])
    Task.objects.filter(group=cpu_only.group).update(gpu_required=0, gpu_memory_mb=None)

    routes = gateway.call(gateway.app.catalog.routes(tenancy.tenant.pk))
    cards = {b.task_id: b.cards for model in routes.values() for s in model for b in s.backends}
    assert cards[whole.pk] == 2.0 and cards[share.pk] == 0.25 and cards[unknown_size.pk] == 1.0
    assert cards[unbound.pk] == 2.0  # no ledger row: what it asked for
    assert [b.cards for b in routes["mem"][0].backends] == [1.0]  # a share of a card, not bound: the card
    assert [b.cards for b in routes["cpu"][0].backends] == [0.0]
    qwen = routes["qwen"][0]
    assert qwen.cards_of("http://127.0.0.1:9001") == 0.25 and qwen.cards_of("http://127.0.0.1:1") == 0.0
