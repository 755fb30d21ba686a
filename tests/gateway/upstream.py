"""A fast stand-in OpenAI-compatible upstream (a raw ASGI app under uvicorn, in a thread),
registered as an inference service's replica in the gateway's tests: chat (streaming and
not, with `stream_options.include_usage`), completions, embeddings, models. It says who
answered (`system_fingerprint`, header `x-upstream`) and records what it was sent; the
body's `standin` object steers it: `delay` between stream events, `die_after` events
(the connection is dropped mid-stream), `status` (answer that HTTP status)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import orjson
import uvicorn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Dropped(Exception):
    """Raised after the response started: uvicorn drops the connection mid-body."""


class Upstream:
    def __init__(self, name: str):
        self.name = name
        self.requests: list[tuple[str, dict, dict]] = []
        self.active = 0  # streams in progress
        self.cancelled = 0  # streams whose client (the gateway) went away
        self.completed = 0
        self.unhealthy = False  # GET /health answers 503

    def reset(self):
        self.requests.clear()
        self.active = self.cancelled = self.completed = 0
        self.unhealthy = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = orjson.loads(body) if body else {}
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if scope["path"] != "/health":
            self.requests.append((scope["path"], data, headers))
        steer = data.get("standin") or {}
        if steer.get("status"):
            return await self.json(send, steer["status"], {"error": {"message": "refused by the stand-in"}})
        path = scope["path"]
        if path == "/health":
            return await self.json(send, 503 if self.unhealthy else 200, {"status": "ok"})
        if path == "/v1/models":
            return await self.json(send, 200, {"object": "list", "data": [{"id": "stand-in", "object": "model"}]})
        if path == "/v1/embeddings":
            inputs = data.get("input")
            inputs = inputs if isinstance(inputs, list) else [inputs]
            return await self.json(
                send,
                200,
                {
                    "object": "list",
                    "model": data.get("model"),
                    "data": [
                        {"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]} for i in range(len(inputs))
                    ],
                    "usage": {"prompt_tokens": 4 * len(inputs), "total_tokens": 4 * len(inputs)},
                },
            )
        chat = path == "/v1/chat/completions"
        if data.get("stream"):
            return await self.stream(receive, send, data, chat, steer)
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": f"hello from {self.name}"},
                "finish_reason": "stop",
            }
            if chat
            else {"index": 0, "text": f"hello from {self.name}", "finish_reason": "stop", "logprobs": None}
        )
        return await self.json(
            send,
            200,
            {
                "id": "cmpl-1",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": data.get("model"),
                "system_fingerprint": self.name,
                "choices": [choice],
                "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
            },
        )

    async def json(self, send, status, body):
        payload = orjson.dumps(body)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"x-upstream", self.name.encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def stream(self, receive, send, data, chat, steer):
        events = int(data.get("max_tokens") or 3)
        delay = float(steer.get("delay", 0))
        die_after = steer.get("die_after")
        gone = asyncio.Event()

        async def watch():
            while True:
                if (await receive())["type"] == "http.disconnect":
                    gone.set()
                    return

        watcher = asyncio.create_task(watch())
        self.active += 1
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"x-upstream", self.name.encode())],
                }
            )
            for i in range(events):
                if die_after is not None and i >= die_after:
                    raise Dropped()
                if gone.is_set():
                    self.cancelled += 1
                    return
                delta = {"delta": {"content": "tok "}} if chat else {"text": "tok "}
                chunk = {
                    "id": "c1",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": 0,
                    "model": data.get("model"),
                    "system_fingerprint": self.name,
                    "choices": [{"index": 0, **delta, "finish_reason": None}],
                }
                await send(
                    {"type": "http.response.body", "body": b"data: " + orjson.dumps(chunk) + b"\n\n", "more_body": True}
                )
                if delay:
                    try:
                        await asyncio.wait_for(gone.wait(), delay)
                    except TimeoutError:
                        pass
            if (data.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": data.get("model"),
                    "choices": [],
                    "usage": {"prompt_tokens": 5, "completion_tokens": events, "total_tokens": 5 + events},
                }
                await send(
                    {"type": "http.response.body", "body": b"data: " + orjson.dumps(usage) + b"\n\n", "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            self.completed += 1
        finally:
            self.active -= 1
            watcher.cancel()


class Served:
    """An ASGI app under uvicorn on a free local port, in a thread with its own loop."""

    def __init__(self, app, port: int | None = None):
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="critical", lifespan="off", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"could not start a server on port {self.port}")
            time.sleep(0.01)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def call(self, coroutine, timeout: float = 10):
        """Run a coroutine on the server's loop (the app's pools live there)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
