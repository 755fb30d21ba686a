"""The tunnel's two ASGI routes in front of Django (docs/tunnel.md, docs/api.md#tunnel).

- `POST /api/v1/nodes/{id}/tunnel` (the agent key): a node registers its tunnel host
  key, pinned on first use (apps.tunnel.pinning), and learns where to dial and the
  control plane's client key. Raw SQL on a pool of its own, like the heartbeat.
- `GET /api/v1/tasks/{id}/tunnel?port=N` and `/api/v1/tasks/{id}/exec?argv=…&tty=1…`
  (WebSocket, `Authorization: Bearer`, or `ticket=` from the portal's terminal page):
  a user's way into a running task. Who may enter is checked once, at the start
  (apps.tunnel.entry: the task's tenant's members and admins, operators; 404 for a task
  the caller cannot see, 403 for a viewer, 409 when the task does not run); then the
  session is spliced to the tunnel process that holds the task's node
  (apps.tunnel.registry), on whichever instance that is, and the bytes never touch
  Django. The tunnel process audits it and enforces its idle timeout and maximum length.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from urllib.parse import parse_qs

import orjson
from django.conf import settings

from apps.core.asgi import header, host_is_allowed, is_secure
from apps.core.error_codes import CoreErrorCode
from apps.core.redis import async_client
from apps.nodes.api.agent_route import AgentRoute, HttpError, orjson_or_400
from apps.tunnel import entry, frames, keys, pinning, registry
from apps.tunnel.choices import SessionKind
from apps.tunnel.entry import Denied, Entry
from apps.tunnel.error_codes import TunnelErrorCode

logger = logging.getLogger(__name__)

REGISTER_PATH = re.compile(r"^/api/v1/nodes/(?P<node_id>[^/]+)/tunnel/?$")
USER_PATH = re.compile(r"^/api/v1/tasks/(?P<task_id>[1-9][0-9]{0,17})/(?P<what>tunnel|exec)/?$")
READ_BYTES = 256 * 1024
MAX_ARGV = 256


class TunnelRegisterApp(AgentRoute):
    path = REGISTER_PATH
    what = "a tunnel registration"

    def pool_size(self) -> int:
        return 2

    def body_limit(self) -> int:
        return 4096

    async def respond(self, scope, receive, node_id: str) -> tuple[int, dict]:
        self.check_request(scope, node_id)
        payload = orjson_or_400(await self.body(scope, receive))
        public_key = pinning.normal_key(payload.get("host_key") if isinstance(payload, dict) else None)
        if public_key is None:
            raise HttpError(
                400, CoreErrorCode.INVALID, "host_key: an ed25519 public key.", {"host_key": ["An ed25519 key."]}
            )
        async with (await self.pool()).connection() as conn:
            pinned = await pinning.pin(conn, node_id, public_key)
        if not pinned.ok:
            if not pinned.node_known:
                raise HttpError(404, TunnelErrorCode.NODE_UNKNOWN, pinned.why)
            logger.warning("tunnel: node %s offered a host key other than the pinned one", node_id)
            raise HttpError(409, TunnelErrorCode.HOST_KEY_MISMATCH, pinned.why)
        return 200, {
            "host": settings.HETEROFLOW_TUNNEL_PUBLIC_HOST,
            "port": settings.HETEROFLOW_TUNNEL_PUBLIC_PORT or settings.HETEROFLOW_TUNNEL_PORT,
            "client_key": keys.client_public_key(),
            "username": "heteroflow",
        }


# --- the users' way in ------------------------------------------------------------------


def _query(scope) -> dict[str, list[str]]:
    return parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)


def _int(values: list[str] | None, name: str, low: int, high: int, default=None) -> int | None:
    if not values:
        return default
    try:
        value = int(values[-1])
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise Denied(400, CoreErrorCode.INVALID, f"{name}: an integer from {low} to {high}.")
    return value


class TunnelUserApp:
    """The WebSocket routes; every other scope goes to `fallback`."""

    def __init__(self, fallback):
        self.fallback = fallback

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            matched = USER_PATH.match(scope["path"])
            if matched:
                await self.session(scope, receive, send, int(matched["task_id"]), matched["what"])
                return
        await self.fallback(scope, receive, send)

    async def session(self, scope, receive, send, task_id: int, what: str) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            request = self.request(scope, task_id, what)
            admitted = await self.authorize(request.pop("token"), request.pop("ticket"), task_id, request.pop("rank"))
            reader, writer = await open_relay(admitted, request)
        except Denied as denied:
            await deny(scope, send, denied.status, denied.body)
            return
        await send({"type": "websocket.accept"})
        try:
            if what == "tunnel":
                await splice_port(receive, send, reader, writer)
            else:
                await splice_exec(receive, send, reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await send({"type": "websocket.close", "code": 1000})

    def request(self, scope, task_id: int, what: str) -> dict:
        if not host_is_allowed(scope):
            raise Denied(400, CoreErrorCode.BAD_REQUEST, "Invalid HTTP_HOST header.")
        if settings.SECURE_SSL_REDIRECT and not is_secure(scope):
            raise Denied(403, CoreErrorCode.HTTPS_REQUIRED, "Use wss://.")
        authorization = header(scope, b"authorization") or ""
        scheme, _, token = authorization.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        query = _query(scope)
        ticket = (query.get("ticket") or [""])[-1]
        if not token and not ticket:
            raise Denied(401, CoreErrorCode.NOT_AUTHENTICATED, "Authentication credentials were not provided.")
        request = {
            "token": token,
            "ticket": ticket if not token else "",
            "rank": _int(query.get("rank"), "rank", 0, 100_000),
            "task": task_id,
        }
        if what == "tunnel":
            port = _int(query.get("port"), "port", 1, 65535)
            if port is None:
                raise Denied(400, CoreErrorCode.INVALID, "port: the task's port to reach (1-65535).")
            request |= {"kind": SessionKind.PORT, "port": port}
            return request
        argv = query.get("argv") or []
        if len(argv) > MAX_ARGV or any("\0" in part for part in argv):
            raise Denied(400, CoreErrorCode.INVALID, f"argv: at most {MAX_ARGV} arguments, without NUL.")
        request |= {"kind": SessionKind.EXEC, "argv": argv}
        if query.get("tty", ["0"])[-1] in ("1", "true"):
            request["tty"] = {
                "term": (query.get("term") or ["xterm"])[-1][:64],
                "cols": _int(query.get("cols"), "cols", 1, 1000, 80),
                "rows": _int(query.get("rows"), "rows", 1, 1000, 24),
            }
        return request

    async def authorize(self, token: str, ticket: str, task_id: int, rank: int | None) -> Entry:
        """Who the session is and whether they may enter (apps.tunnel.entry). A ticket is
        good once: its nonce is claimed in Redis before anything else is read. Raises
        Denied."""
        if token:
            return await asyncio.to_thread(entry.authorize_bearer, token, task_id, rank)
        body = await claim_ticket(ticket, task_id, used="This terminal ticket was used already.")
        return await asyncio.to_thread(entry.authorize_ticket, body, task_id, rank)


async def claim_ticket(ticket: str, task_id: int, *, used: str) -> dict:
    """A ticket's body once it is genuine, for this task, and claimed: its nonce set in
    Redis (SET NX), so it is good once. Raises Denied (`used` says it was used already)."""
    body = entry.read_ticket(ticket, task_id)
    try:
        claimed = await async_client().set(
            entry.TICKET_NONCE_KEY.format(body.get("n")), 1, nx=True, ex=2 * entry.TICKET_SECONDS
        )
    except Exception as error:  # noqa: BLE001
        logger.warning("tunnel: cannot claim a ticket: %s", error)
        raise Denied(503, CoreErrorCode.UNAVAILABLE, "Tickets cannot be checked now; retry.") from None
    if not claimed:
        raise Denied(401, CoreErrorCode.AUTHENTICATION_FAILED, used)
    return body


async def open_relay(entry: Entry, request: dict):
    """A connection to the tunnel process holding the task's node, the session asked
    for and granted. Raises Denied."""
    try:
        holder = await registry.holder(async_client(), entry.node_id)
    except Exception as error:  # noqa: BLE001
        logger.warning("tunnel: cannot read the tunnel registry: %s", error)
        holder = None
    if holder is None:
        raise Denied(503, TunnelErrorCode.NODE_UNREACHABLE, f"Node {entry.node_id} has no tunnel open; retry.")
    host, _, port = holder.rpartition(":")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port), limit=1 << 20), 5)
    except (TimeoutError, OSError, ValueError):
        raise Denied(
            503, TunnelErrorCode.NODE_UNREACHABLE, f"The tunnel of node {entry.node_id} is away; retry."
        ) from None
    with contextlib.suppress(OSError):
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header_ = {key: value for key, value in request.items() if key != "token"}
    writer.write(keys.sign(header_ | {"node": entry.node_id, "task": entry.task_id, "who": entry.who}))
    try:
        answer = orjson.loads(await asyncio.wait_for(reader.readline(), 35))
    except (TimeoutError, orjson.JSONDecodeError, ConnectionError):
        writer.close()
        raise Denied(503, TunnelErrorCode.NODE_UNREACHABLE, "The tunnel process did not answer; retry.") from None
    if not answer.get("ok"):
        writer.close()
        code = answer.get("code") or CoreErrorCode.ERROR
        status = 403 if code == TunnelErrorCode.REFUSED_BY_NODE else 503
        raise Denied(status, code, answer.get("message") or "Refused.")
    return reader, writer


async def deny(scope, send, status: int, body: dict) -> None:
    """Refuse the WebSocket with an HTTP answer (the ASGI extension), or by closing it
    with 4000 + status where the server lacks it."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        payload = orjson.dumps(body)
        await send(
            {
                "type": "websocket.http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "websocket.http.response.body", "body": payload})
        return
    await send({"type": "websocket.close", "code": 4000 + status, "reason": body["error"]["message"][:120]})


async def _from_user(receive):
    """The user's messages: bytes, or a dict for a text (JSON) message; None when gone."""
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return None
        if message.get("bytes") is not None:
            return message["bytes"]
        if message.get("text") is not None:
            try:
                return orjson.loads(message["text"])
            except orjson.JSONDecodeError:
                continue


async def splice_port(receive, send, reader, writer) -> None:
    async def user_to_task() -> None:
        while (message := await _from_user(receive)) is not None:
            if isinstance(message, bytes):
                writer.write(message)
                await writer.drain()
            elif isinstance(message, dict) and message.get("eof"):
                with contextlib.suppress(OSError):
                    writer.write_eof()
        writer.close()

    async def task_to_user() -> None:
        while data := await reader.read(READ_BYTES):
            await send({"type": "websocket.send", "bytes": data})

    await until_either_ends(user_to_task(), task_to_user())


async def splice_exec(receive, send, reader, writer) -> None:
    async def user_to_task() -> None:
        while (message := await _from_user(receive)) is not None:
            if isinstance(message, bytes) and message and message[0] in (frames.STDIN, frames.RESIZE, frames.EOF):
                writer.write(frames.pack(message[0], message[1:]))
                await writer.drain()
        writer.close()

    async def task_to_user() -> None:
        while (frame := await frames.read(reader)) is not None:
            await send({"type": "websocket.send", "bytes": bytes([frame[0]]) + frame[1]})
            if frame[0] == frames.EXIT:
                return

    await until_either_ends(user_to_task(), task_to_user())


async def until_either_ends(user_to_task, task_to_user) -> None:
    """Until the task's side ends (its last bytes sent) or the user leaves."""
    up, down = asyncio.ensure_future(user_to_task), asyncio.ensure_future(task_to_user)
    try:
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pump in (up, down):
            pump.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
