"""Which tunnel process holds a node's tunnel, in Redis (docs/tunnel.md#instances).

The instance holding a node's tunnel writes `heteroflow:tunnel:node:ID` = its relay
address with a TTL, and refreshes every held node's key each REFRESH_SECONDS in one
pipeline; it deletes the key when the tunnel closes, only if it still names itself (a
node that reconnected to another instance meanwhile is not unlisted by the first). A
web process reads the key to know where to splice a user's session. Losing Redis loses
nothing that matters: the instances write their keys again at their next refresh."""

from __future__ import annotations

KEY = "heteroflow:tunnel:node:{node_id}"
TTL_SECONDS = 30
REFRESH_SECONDS = 10
# delete the key only while it names this instance
_FORGET = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


def key(node_id: str) -> str:
    return KEY.format(node_id=node_id)


async def hold(redis, node_id: str, address: str) -> None:
    await redis.set(key(node_id), address, ex=TTL_SECONDS)


async def refresh(redis, node_ids, address: str) -> None:
    if not node_ids:
        return
    async with redis.pipeline(transaction=False) as pipe:
        for node_id in node_ids:
            pipe.set(key(node_id), address, ex=TTL_SECONDS)
        await pipe.execute()


async def forget(redis, node_id: str, address: str) -> None:
    await redis.eval(_FORGET, 1, key(node_id), address)


async def holder(redis, node_id: str) -> str | None:
    found = await redis.get(key(node_id))
    return found.decode() if isinstance(found, bytes) else found
