"""The thin ASGI routes that sit in front of Django (the heartbeat, the task create, the
gateway) and what they share: the base class that answers some requests and hands the
rest on (`ThinRoute`); reading a request's headers from the ASGI scope as Django would
read them; reading a body within a limit (`read_body`) and sending a JSON answer
(`send_json`); and the API's body limit in front of Django (`BodyLimit`)."""

from __future__ import annotations

import orjson
from django.conf import settings
from django.http.request import split_domain_port, validate_host

from apps.core.error_codes import CoreErrorCode
from apps.core.errors import error_body


class ThinRoute:
    """An ASGI app in front of another (`fallback`, in the end Django): the HTTP requests
    `match` picks are answered here, by `handle`; everything else goes on unchanged,
    the lifespan included unless a route takes it."""

    def __init__(self, fallback):
        self.fallback = fallback

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            matched = self.match(scope)
            if matched is not None:
                await self.handle(scope, receive, send, matched)
                return
        elif scope["type"] == "lifespan":
            await self.lifespan(scope, receive, send)
            return
        await self.fallback(scope, receive, send)

    def match(self, scope):
        """None for a request this route does not answer; else what `handle` is given
        (a path's parts, or True)."""
        raise NotImplementedError

    async def handle(self, scope, receive, send, matched) -> None:
        raise NotImplementedError

    async def lifespan(self, scope, receive, send) -> None:
        await self.fallback(scope, receive, send)


class BodyTooLarge(Exception):
    """The body is (or says it is) over the limit; each route answers 413 in its words."""

    def __init__(self, limit: int):
        super().__init__(limit)
        self.limit = limit


class ClientGone(Exception):
    """The client went away before the body's end."""


async def read_body(scope, receive, limit: int | None = None) -> bytes:
    """The whole body: BodyTooLarge once a declared Content-Length or the bytes received
    pass `limit` (None: no limit), ClientGone if the client leaves first."""
    if limit is not None:
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def send_json(send, status: int, body, headers=(), *, option: int = 0) -> None:
    """`body` as JSON (orjson, with `option`), its length, then `headers`."""
    payload = orjson.dumps(body, option=option)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def header(scope, name: bytes) -> str | None:
    """The value of header `name` (lower case, as ASGI gives names), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def is_secure(scope) -> bool:
    """HttpRequest.is_secure() for an ASGI scope: https, or the proxy header the operator
    trusts (SECURE_PROXY_SSL_HEADER)."""
    if scope.get("scheme") == "https":
        return True
    proxy_header = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy_header:
        name, value = proxy_header
        wire_name = name.removeprefix("HTTP_").lower().replace("_", "-").encode()
        return header(scope, wire_name) == value
    return False


def host_is_allowed(scope) -> bool:
    """What HttpRequest.get_host() checks: the Host header against ALLOWED_HOSTS."""
    return bool(validate_host(split_domain_port(header(scope, b"host") or "")[0], settings.ALLOWED_HOSTS))


class BodyLimit:
    """Bodies over the limit refused before they are read, in front of Django (whose ASGI
    handler reads the whole body, spooling it to disk, before any view runs). A declared
    Content-Length over the limit is answered 413 at once; a body without one (chunked) is
    counted as it arrives and cut at the limit: the application sees the client leave,
    and the client gets the 413. Only the API's paths: the portal and the admin keep
    Django's own checks (DATA_UPLOAD_MAX_MEMORY_SIZE on form fields)."""

    PATHS = ("/api/",)

    def __init__(self, app, limit: int | None = None):
        self.app, self._limit = app, limit

    @property
    def limit(self) -> int:
        return self._limit or settings.HETEROFLOW_API_MAX_BODY_BYTES

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.PATHS):
            await self.app(scope, receive, send)
            return
        limit = self.limit
        length = header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            await too_large(send, limit)
            return
        seen, over, started = 0, False, False

        async def counted():
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def watched(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counted, watched)
        if over and not started:
            await too_large(send, limit)


async def too_large(send, limit: int) -> None:
    await send_json(send, 413, error_body(CoreErrorCode.PAYLOAD_TOO_LARGE, f"The body may be at most {limit} bytes."))
