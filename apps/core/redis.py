"""The one way server code (outside the async hot paths, which keep their own asyncio
clients) talks to Redis: a client per process, bounded by 2 s timeouts so that a Redis
that is away fails a call instead of hanging it. redis-py's pool is fork-safe (a forked
worker opens its own connections)."""

from __future__ import annotations

from functools import cache

import redis
from django.conf import settings


@cache
def client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


_async_clients: dict = {}


def async_client():
    """An asyncio client for the running event loop (one per loop: a connection belongs
    to the loop it was made on). No socket_timeout: callers bound their own waits."""
    import asyncio  # noqa: PLC0415

    from redis import asyncio as aioredis  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    found = _async_clients.get(loop)
    if found is None:
        for old in [key for key in _async_clients if key.is_closed()]:
            del _async_clients[old]
        found = _async_clients[loop] = aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2)
    return found
