"""The Redis batcher under the limits: the script calls of one event-loop turn share one
pipeline, scripts are loaded when Redis does not know them (a flush, a restart), and an
error reaches every caller of the batch."""

import asyncio
import uuid

import pytest
from django.conf import settings
from redis import asyncio as aioredis
from redis.exceptions import ResponseError

from apps.gateway.limits import Batcher

ECHO = "return {KEYS[1], ARGV[1]}"
BOOM = "return redis.error_reply('boom')"


def run(coroutine):
    async def go():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            return await coroutine(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_calls_of_one_turn_share_a_pipeline_and_unknown_scripts_are_loaded():
    unknown = f"-- {uuid.uuid4()}\n{ECHO}"  # a script this Redis never saw (no SCRIPT FLUSH on a shared server)

    async def go(client):
        batcher = Batcher(client)
        pipelines = []
        original = batcher._run

        async def counted(batch):
            pipelines.append(len(batch))
            return await original(batch)

        batcher._run = counted
        answers = await asyncio.gather(*(batcher.call(unknown, [f"k{i}"], [i]) for i in range(20)))
        again = await batcher.call(unknown, ["x"], ["y"])
        return answers, again, pipelines

    answers, again, pipelines = run(go)
    assert answers == [[f"k{i}".encode(), str(i).encode()] for i in range(20)]
    assert again == [b"x", b"y"]
    assert pipelines == [20, 20, 1]  # one pipeline, again for the NOSCRIPT ones, then the next turn's


def test_an_error_reaches_its_caller_only_and_a_dead_redis_every_caller():
    async def go(client):
        batcher = Batcher(client)
        good, bad = batcher.call(ECHO, ["k"], [1]), batcher.call(BOOM, [], [])
        results = await asyncio.gather(good, bad, return_exceptions=True)
        dead = Batcher(aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5))
        lost = await asyncio.gather(dead.call(ECHO, ["k"], [1]), dead.call(ECHO, ["k"], [2]), return_exceptions=True)
        return results, lost

    (good, bad), lost = run(go)
    assert good == [b"k", b"1"] and isinstance(bad, ResponseError) and "boom" in str(bad)
    assert all(isinstance(error, Exception) for error in lost)


@pytest.mark.parametrize("calls", [1, 3])
def test_a_caller_that_gave_up_does_not_break_the_others(calls):
    async def go(client):
        batcher = Batcher(client)
        futures = [batcher.call(ECHO, ["k"], [i]) for i in range(calls)]
        futures[0].cancel()
        return await asyncio.gather(*futures[1:])

    assert len(run(go)) == calls - 1
