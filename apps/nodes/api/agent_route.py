"""What the agent's thin routes (the heartbeat, the live log ingestion) share: the
checks Django's middleware would make (host, HTTPS), the method, the agent key, the node
id in the path, a bounded JSON body, and an async connection pool of their own per event
loop. Each route says what it answers in `respond`."""

from __future__ import annotations

import hmac
import re

import orjson
from django.conf import settings

from apps.core.asgi import BodyTooLarge, ClientGone, ThinRoute, header, host_is_allowed, is_secure, read_body, send_json
from apps.core.db import LoopPool
from apps.core.error_codes import CoreErrorCode
from apps.core.errors import error_body

NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str, fields: dict | None = None, headers=()):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(code, message, fields), list(headers)


class AgentRoute(ThinRoute):
    path: re.Pattern  # with a `node_id` group
    methods: tuple[str, ...] = ("POST",)
    what = "a request"  # in the 413's words: "{what} may be at most N bytes"

    def __init__(self, fallback):
        super().__init__(fallback)
        # a connection the database ended (a restart, a terminated backend) is found and
        # replaced when taken, never handed to a request to fail on
        self._pool = LoopPool(self.pool_size, server_settings=self.server_settings())

    def server_settings(self) -> dict:
        """PostgreSQL settings of this route's connections."""
        return {}

    def match(self, scope) -> str | None:
        found = self.path.match(scope["path"])
        return found["node_id"] if found else None

    def pool_size(self) -> int:
        raise NotImplementedError

    def body_limit(self) -> int:
        raise NotImplementedError

    async def pool(self):
        return await self._pool.get()

    async def close(self) -> None:
        await self._pool.close()

    async def handle(self, scope, receive, send, node_id: str) -> None:
        try:
            status, body = await self.respond(scope, receive, node_id)
            headers = []
        except HttpError as exc:
            status, body, headers = exc.status, exc.body, exc.headers
        self.record(status, body)
        await send_json(send, status, body, headers)

    def record(self, status: int, body: dict) -> None:
        """Count the answer (a route's metric)."""

    async def respond(self, scope, receive, node_id: str) -> tuple[int, dict]:
        raise NotImplementedError

    def check_request(self, scope, node_id: str) -> None:
        """What Django's middleware would do for any other endpoint (the host check, the
        HTTPS redirect: the agent key must not travel in clear in production), then the
        method, the agent key and the node id. Raises HttpError."""
        host = header(scope, b"host") or ""
        if not host_is_allowed(scope):
            raise HttpError(400, CoreErrorCode.BAD_REQUEST, f"Invalid HTTP_HOST header: {host!r}.")
        if settings.SECURE_SSL_REDIRECT and not is_secure(scope):
            location = f"https://{host}{scope['path']}".encode()
            raise HttpError(301, CoreErrorCode.HTTPS_REQUIRED, "Use HTTPS.", headers=[(b"location", location)])
        if scope["method"] not in self.methods:
            raise HttpError(
                405,
                CoreErrorCode.METHOD_NOT_ALLOWED,
                f'Method "{scope["method"]}" not allowed.',
                headers=[(b"allow", ", ".join(self.methods).encode())],
            )
        authenticate_agent(scope)
        if not NODE_ID.match(node_id):
            raise HttpError(
                400,
                CoreErrorCode.INVALID,
                "Invalid node id.",
                {"node_id": ["1-128 characters: letters, digits, '.', '_', ':', '-'."]},
            )

    async def body(self, scope, receive) -> bytes:
        try:
            return await read_body(scope, receive, self.body_limit())
        except BodyTooLarge as exc:
            raise HttpError(
                413, CoreErrorCode.PAYLOAD_TOO_LARGE, f"{self.what.capitalize()} may be at most {exc.limit} bytes."
            ) from None
        except ClientGone:
            raise HttpError(400, CoreErrorCode.PARSE_ERROR, "The client went away.") from None


def authenticate_agent(scope) -> None:
    """The agent key (X-API-Key), compared in constant time. Raises HttpError."""
    offered = header(scope, b"x-api-key")
    expected = settings.HETEROFLOW_AGENT_SECRET or ""
    if offered is None:
        if header(scope, b"authorization"):
            raise HttpError(403, CoreErrorCode.PERMISSION_DENIED, "This route takes the agent key (X-API-Key).")
        raise HttpError(
            401,
            CoreErrorCode.NOT_AUTHENTICATED,
            "Authentication credentials were not provided.",
            headers=[(b"www-authenticate", b'Bearer realm="heteroflow"')],
        )
    if not expected or not hmac.compare_digest(offered.encode(), expected.encode()):
        raise HttpError(
            401,
            CoreErrorCode.AUTHENTICATION_FAILED,
            "Invalid agent key.",
            headers=[(b"www-authenticate", b'Bearer realm="heteroflow"')],
        )


def orjson_or_400(body: bytes):
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HttpError(400, CoreErrorCode.PARSE_ERROR, f"JSON parse error - {exc}") from None
