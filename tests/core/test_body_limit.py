"""Bodies over the API's limit are refused before they are read (apps.core.asgi.BodyLimit):
a declared Content-Length at once, a chunked body cut where it passes the limit, with the
JSON error shape and nothing written. Driven over ASGI, as uvicorn would call it."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from apps.core.asgi import BodyLimit
from apps.tasks.models import Task, TaskGroup
from apps.tenants.services import issue_platform_key
from tests.factories import OperatorFactory
from tests.headers import bearer_http
from tests.live import start_control_plane, stop_process

LIMIT = 1000


class Recorder:
    """A stand-in for Django behind the limit: reads the whole body, as Django's ASGI
    handler does, and answers 201 with its length; notes whether it saw the client leave."""

    def __init__(self):
        self.read, self.left = b"", False

    async def __call__(self, scope, receive, send):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.left = True
                return
            self.read += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": str(len(self.read)).encode()})


def call(app, path: str, chunks: list[bytes], length: int | None):
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    messages = [
        {"type": "http.request", "body": chunk, "more_body": n < len(chunks) - 1} for n, chunk in enumerate(chunks)
    ]
    taken = []
    sent = []

    async def receive():
        if messages:
            message = messages.pop(0)
            taken.append(message)
            return message
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, len(taken)


def test_a_declared_length_over_the_limit_is_refused_before_anything_is_read():
    inner = Recorder()
    status, body, taken = call(BodyLimit(inner, LIMIT), "/api/v1/tasks", [b"x" * 2000], 2000)
    assert status == 413 and taken == 0 and inner.read == b""
    assert orjson.loads(body)["error"]["code"] == "payload_too_large"


def test_a_chunked_body_is_cut_where_it_passes_the_limit():
    inner = Recorder()
    chunks = [b"x" * 400] * 10  # 4,000 bytes, no Content-Length
    status, body, taken = call(BodyLimit(inner, LIMIT), "/api/v1/tasks", chunks, None)
    assert status == 413 and orjson.loads(body)["error"]["code"] == "payload_too_large"
    assert inner.left and len(inner.read) <= LIMIT  # the application never got past the limit
    assert taken == 3  # and no more was read from the client than it took to pass it


@pytest.mark.parametrize(
    ("path", "chunks", "length"),
    [
        ("/api/v1/tasks", [b"x" * 600, b"x" * 400], 1000),  # exactly the limit
        ("/api/v1/tasks", [b"x" * 500, b"x" * 500], None),
        ("/portal/tasks/new", [b"x" * 5000], 5000),  # not the API: Django's own checks apply
    ],
)
def test_bodies_within_the_limit_and_other_paths_pass(path, chunks, length):
    inner = Recorder()
    status, body, _ = call(BodyLimit(inner, LIMIT), path, chunks, length)
    assert status == 201 and int(body) == sum(map(len, chunks))


@pytest.mark.django_db(transaction=True)
def test_the_live_server_refuses_a_large_body_and_writes_nothing(settings):
    """Through the whole ASGI stack (heteroflow.asgi): a task create and a group create of
    3 MB with an operator key are 413s, and nothing was written."""
    key = issue_platform_key(user=OperatorFactory(username="big"), name="big").key
    server, url = start_control_plane()
    try:
        body = b'{"tenant": "x", "name": "' + b"x" * 3_000_000 + b'"}'
        for path in ("/api/v1/tasks", "/api/v1/task-groups"):
            response = httpx.post(
                f"{url}{path}", content=body, headers=bearer_http(key) | {"Content-Type": "application/json"}
            )
            assert response.status_code == 413, response.text
            assert response.json()["error"]["code"] == "payload_too_large"
    finally:
        stop_process(server)
    assert not Task.objects.exists() and not TaskGroup.objects.exists()
