"""Heartbeats sent through the real ASGI route, for the tests of the heartbeat and of
what it counts (the `agents` fixture in tests/conftest.py is one of these)."""

import asyncio

import httpx

from apps.nodes.api.heartbeat import HeartbeatApp
from tests.headers import AGENT_HTTP


async def _not_found(scope, receive, send):
    await send({"type": "http.response.start", "status": 404, "headers": []})
    await send({"type": "http.response.body", "body": b"django"})


class Agents:
    """Sends heartbeats through the real ASGI route (auth, limits, parsing, validation,
    the async pool) from a chosen TCP source address."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.app = HeartbeatApp(_not_found)

    def send(
        self, node_id, payload=None, *, method="POST", headers=AGENT_HTTP, peer="203.0.113.10", content=None, path=None
    ):
        async def go():
            transport = httpx.ASGITransport(app=self.app, client=(peer, 40000))
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                url = path or f"/api/v1/nodes/{node_id}/heartbeat"
                if content is not None:
                    return await client.request(method, url, content=content, headers=headers)
                return await client.request(method, url, json=payload, headers=headers)

        return self.loop.run_until_complete(go())

    def close(self):
        self.loop.run_until_complete(self.app.close())
        self.loop.close()
