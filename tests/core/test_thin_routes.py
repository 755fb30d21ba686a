"""What the thin ASGI routes share (apps.core.asgi): the base class's dispatch,
`read_body` within a limit and `send_json`. No database: plain ASGI calls."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from apps.core.asgi import BodyTooLarge, ClientGone, ThinRoute, read_body, send_json


def receiving(*messages):
    queue = list(messages)

    async def receive():
        return queue.pop(0)

    return receive


def scope_with(length: str | None = None, path: str = "/x", type_: str = "http") -> dict:
    headers = [(b"content-length", length.encode())] if length is not None else []
    return {"type": type_, "path": path, "headers": headers}


def test_a_body_in_chunks_is_read_whole():
    receive = receiving(
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd"},
    )
    assert asyncio.run(read_body(scope_with("4"), receive, 4)) == b"abcd"


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    async def never():
        raise AssertionError("read")

    with pytest.raises(BodyTooLarge) as caught:
        asyncio.run(read_body(scope_with("5"), never, 4))
    assert caught.value.limit == 4


def test_a_body_without_a_length_is_cut_at_the_limit():
    receive = receiving(
        {"type": "http.request", "body": b"abc", "more_body": True},
        {"type": "http.request", "body": b"de", "more_body": True},
    )
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(scope_with(), receive, 4))


def test_no_limit_reads_it_all_and_a_client_gone_says_so():
    receive = receiving({"type": "http.request", "body": b"x" * 10_000})
    assert asyncio.run(read_body(scope_with("1"), receive)) == b"x" * 10_000
    gone = receiving({"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"})
    with pytest.raises(ClientGone):
        asyncio.run(read_body(scope_with(), gone, 100))


def test_send_json_sends_the_length_then_the_headers_given():
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(send_json(send, 201, {"a": 1}, [(b"x-one", b"1")]))
    start, body = sent
    assert start == {
        "type": "http.response.start",
        "status": 201,
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"7"), (b"x-one", b"1")],
    }
    assert body == {"type": "http.response.body", "body": orjson.dumps({"a": 1})}


class Answers(ThinRoute):
    def match(self, scope):
        return scope["path"].removeprefix("/mine/") if scope["path"].startswith("/mine/") else None

    async def handle(self, scope, receive, send, matched):
        await send({"matched": matched})


def test_a_thin_route_answers_what_it_matches_and_hands_on_the_rest():
    handed_on, sent = [], []

    async def behind(scope, receive, send):
        handed_on.append((scope["type"], scope.get("path")))

    async def send(message):
        sent.append(message)

    route = Answers(behind)
    asyncio.run(route(scope_with(path="/mine/7"), receiving(), send))
    asyncio.run(route(scope_with(path="/theirs"), receiving(), send))
    asyncio.run(route(scope_with(path="/mine/7", type_="websocket"), receiving(), send))
    asyncio.run(route({"type": "lifespan"}, receiving(), send))
    assert sent == [{"matched": "7"}]
    assert handed_on == [("http", "/theirs"), ("websocket", "/mine/7"), ("lifespan", None)]
