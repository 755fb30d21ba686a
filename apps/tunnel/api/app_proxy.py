"""`/apps/{task_id}/…`: an interactive task's app in the browser, through the tunnel
(docs/interactive.md#in-the-browser). A thin ASGI route in front of Django.

- **Its own host.** An app's pages run their own scripts (a notebook's output is code),
  so they are served only on HETEROFLOW_APP_HOST, never on the control plane's host: there
  they would run with the person's session cookie at hand. With `{id}` in it
  (`{id}.apps.example.com`, a wildcard name), each app has a host, and so an origin, of
  its own. Unset: the browser way in is off (`hf open` still works).
- **Entry.** The task page's *Open* (`/portal/tasks/{id}/open/`, under the person's session)
  admits them as the terminal does (apps.tunnel.entry) and sends them there with a
  one-use ticket (`?hf_ticket=`). Redeemed, it becomes a cookie for this task's path
  only (`hf_app_{id}`, `Path=/apps/{id}/`, HttpOnly, SameSite=Lax, Secure over HTTPS):
  signed with SECRET_KEY, it names the person, their tenant, the task's node and port and
  the app's token, and lasts HETEROFLOW_TUNNEL_MAX_SECONDS. SameSite=Lax keeps other
  sites from using it but for a plain link (a GET the app answers for its person), never
  for a form post, a fetch or a WebSocket. Every
  HETEROFLOW_APP_RECHECK_SECONDS the person and the task are admitted again (a removed
  member, a viewer now, a task that no longer runs are refused from then on; a task
  requeued elsewhere is followed).
- **Each request** goes through a relay session of its own to the task's port (audited
  like `hf port-forward`'s), with the app's token added (`Authorization: token …`), so
  the page never needs it. HTTP is spoken with h11 (one request per connection); a
  WebSocket (Jupyter's kernels) is the browser's socket here and a client socket to the
  app (websockets' protocol, without its I/O) on the relay, message for message.
- The app runs with its base URL at this path (the agent starts Jupyter so), and sees
  the browser's own Host and Origin, so its own origin checks hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from urllib.parse import parse_qs, urlencode

import h11
from django.conf import settings
from django.core import signing
from django.db import connection
from websockets.client import ClientProtocol
from websockets.datastructures import Headers
from websockets.frames import Opcode
from websockets.http11 import Response as WsResponse
from websockets.uri import parse_uri

from apps.core.asgi import header, is_secure
from apps.core.error_codes import CoreErrorCode
from apps.tasks.choices import InteractiveApp, TaskKind
from apps.tasks.models import Task
from apps.tunnel import entry
from apps.tunnel.api.routes import claim_ticket, open_relay, until_either_ends
from apps.tunnel.choices import SessionKind
from apps.tunnel.entry import Denied, Entry

logger = logging.getLogger(__name__)

APP_PATH = re.compile(r"^/apps/(?P<task_id>[1-9][0-9]{0,17})(?P<rest>/.*)?$")
COOKIE_SALT = "heteroflow.tunnel.app"
TICKET_PARAM = "hf_ticket"
HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    b"authorization",
    b"content-length",
}
MAX_BODY = 64 * 1024 * 1024  # a request's body (Jupyter's saves are JSON)
READ = 256 * 1024


def app_path(task_id: int) -> str:
    """Where an interactive task's app is served: its base URL, the same on the agent."""
    return f"/apps/{task_id}/"


def app_host(task_id: int) -> str:
    """The host (and port) the task's app is served on: HETEROFLOW_APP_HOST, with `{id}`
    the task's id where it has one; "" when the browser way in is off."""
    return settings.HETEROFLOW_APP_HOST.replace("{id}", str(task_id))


def is_app_host(host: str) -> bool:
    """Whether `host` is the apps' (any app's, with `{id}`): such a host serves apps only."""
    pattern = settings.HETEROFLOW_APP_HOST.lower()
    if not pattern:
        return False
    if "{id}" not in pattern:
        return host.lower() == pattern
    return re.fullmatch(re.escape(pattern).replace(r"\{id\}", "[1-9][0-9]{0,17}"), host.lower()) is not None


def app_url(task_id: int, secure: bool) -> str:
    return f"{'https' if secure else 'http'}://{app_host(task_id)}{app_path(task_id)}"


def cookie_name(task_id: int) -> str:
    return f"hf_app_{task_id}"


# --- who: the ticket, the cookie, the periodic recheck (in a thread: the ORM) -------------


def admitted_pass(principal, task_id: int) -> dict:
    """What the cookie carries once `principal` is admitted to the task's app. Raises Denied."""
    admitted = entry.admit(principal, task_id)
    task = Task.objects.only("kind", "app", "app_token", "host_port").get(pk=admitted.task_id)
    if task.kind != TaskKind.INTERACTIVE or task.app != InteractiveApp.JUPYTER or not task.host_port:
        raise Denied(409, CoreErrorCode.INVALID_STATE, f"Task {task_id} has no app to open (hf ssh enters a shell).")
    return {
        "k": task_id,
        "n": admitted.node_id,
        "p": task.host_port,
        "a": task.app_token,
        "u": principal.user.pk,
        "t": principal.tenant.slug if principal.tenant is not None else None,
        "w": admitted.who["principal"],
        "c": int(time.time()),
    }


def pass_for_ticket(body: dict, task_id: int) -> dict:
    """The pass of the person a ticket (or a pass due its recheck) names. Raises Denied."""
    try:
        return admitted_pass(entry.ticket_principal(body), task_id)
    finally:
        connection.close()


def rechecked(current: dict, task_id: int) -> dict:
    return pass_for_ticket({"u": current["u"], "t": current["t"]}, task_id)


def read_cookie(scope, task_id: int) -> dict | None:
    raw = header(scope, b"cookie") or ""
    wanted = cookie_name(task_id)
    for part in raw.split(";"):
        name, _, value = part.strip().partition("=")
        if name == wanted:
            try:
                found = signing.loads(value, salt=COOKIE_SALT, max_age=settings.HETEROFLOW_TUNNEL_MAX_SECONDS)
            except signing.BadSignature:
                return None
            return found if isinstance(found, dict) and found.get("k") == task_id else None
    return None


def set_cookie(scope, task_id: int, app_pass: dict) -> tuple[bytes, bytes]:
    value = signing.dumps(app_pass, salt=COOKIE_SALT)
    secure = "; Secure" if is_secure(scope) else ""
    return (
        b"set-cookie",
        f"{cookie_name(task_id)}={value}; Path={app_path(task_id)}; HttpOnly; SameSite=Lax"
        f"; Max-Age={settings.HETEROFLOW_TUNNEL_MAX_SECONDS}{secure}".encode(),
    )


def cleared_cookie(task_id: int) -> tuple[bytes, bytes]:
    return (b"set-cookie", f"{cookie_name(task_id)}=; Path={app_path(task_id)}; Max-Age=0".encode())


# --- the route ------------------------------------------------------------------------


class AppProxy:
    """`/apps/{id}/…`; every other scope goes to `fallback`."""

    def __init__(self, fallback):
        self.fallback = fallback

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and is_app_host(header(scope, b"host") or ""):
            # the apps' host serves its apps and nothing else: an app's scripts there reach
            # no page or API of the control plane's, whatever cookies the browser holds
            matched = APP_PATH.match(scope["path"])
            host = (header(scope, b"host") or "").lower()
            if matched is None or host != app_host(int(matched["task_id"])).lower():
                await not_here(scope, receive, send)
                return
            task_id = int(matched["task_id"])
            if scope["type"] == "http":
                await self.http(scope, receive, send, task_id)
            else:
                await self.websocket(scope, receive, send, task_id)
            return
        await self.fallback(scope, receive, send)

    async def who(self, scope, task_id: int) -> tuple[dict, list]:
        """The person's pass for the task, and the cookie to set with the answer (when it
        was rechecked). Raises Denied."""
        current = read_cookie(scope, task_id)
        if current is None:
            raise Denied(
                403, CoreErrorCode.NOT_AUTHENTICATED, "Open the app from its task's page in the portal (Open)."
            )
        if time.time() - current.get("c", 0) < settings.HETEROFLOW_APP_RECHECK_SECONDS:
            return current, []
        fresh = await asyncio.to_thread(rechecked, current, task_id)
        return fresh, [set_cookie(scope, task_id, fresh)]

    async def relay(self, app_pass: dict):
        admitted = Entry(app_pass["k"], app_pass["n"], {"principal": app_pass["w"], "user_id": app_pass["u"]})
        return await open_relay(admitted, {"kind": SessionKind.PORT, "port": app_pass["p"], "task": app_pass["k"]})

    # --- HTTP ---------------------------------------------------------------------------

    async def http(self, scope, receive, send, task_id: int) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        try:
            if TICKET_PARAM in query:
                body = await claim_ticket(
                    query[TICKET_PARAM][-1], task_id, used="This ticket was used already; open the app again."
                )
                app_pass = await asyncio.to_thread(pass_for_ticket, body, task_id)
                rest = {k: v for k, v in query.items() if k != TICKET_PARAM}
                location = scope["path"] + (f"?{urlencode(rest, doseq=True)}" if rest else "")
                await answer(send, 303, b"", [(b"location", location.encode()), set_cookie(scope, task_id, app_pass)])
                return
            app_pass, cookies = await self.who(scope, task_id)
            reader, writer = await self.relay(app_pass)
        except Denied as denied:
            extra = [cleared_cookie(task_id)] if denied.status in (401, 403) else []
            await answer(send, denied.status, denied.body["error"]["message"].encode(), extra, text=True)
            return
        try:
            await forward_http(scope, receive, send, reader, writer, app_pass["a"], cookies)
        except (ConnectionError, h11.ProtocolError) as error:
            logger.info("app proxy: task %s: the app's connection failed: %s", task_id, error)
            with contextlib.suppress(Exception):  # unless the answer had begun
                await answer(send, 502, b"The app's connection failed; retry.", [], text=True)
        finally:
            writer.close()

    # --- WebSocket ----------------------------------------------------------------------

    async def websocket(self, scope, receive, send, task_id: int) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            app_pass, _ = await self.who(scope, task_id)
            reader, writer = await self.relay(app_pass)
        except Denied as denied:
            await send({"type": "websocket.close", "code": 4000 + denied.status})
            return
        try:
            await forward_websocket(scope, receive, send, reader, writer, app_pass["a"])
        finally:
            writer.close()


async def not_here(scope, receive, send) -> None:
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.close", "code": 4404})
        return
    await answer(send, 404, b"Only interactive tasks' apps are served on this host.", [], text=True)


async def answer(send, status: int, body: bytes, headers: list, *, text: bool = False) -> None:
    kinds = [(b"content-type", b"text/plain; charset=utf-8")] if text else []
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                *kinds,
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def forwarded_headers(scope, token: str, task_id: int) -> list[tuple[bytes, bytes]]:
    """The browser's headers for the app: hop-by-hop ones and our own cookie left out, the
    app's token added."""
    # the proxy's own cookie, and the control plane's should a browser hold them for this host
    ours = tuple(
        f"{name}=".encode() for name in (cookie_name(task_id), settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME)
    )
    headers = []
    for name, value in scope["headers"]:
        if name in HOP_BY_HOP:
            continue
        if name == b"cookie":
            value = b"; ".join(p.strip() for p in value.split(b";") if p.strip() and not p.strip().startswith(ours))
            if not value:
                continue
        headers.append((name, value))
    headers.append((b"authorization", f"token {token}".encode()))
    return headers


async def forward_http(scope, receive, send, reader, writer, token: str, cookies: list) -> None:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if len(body) > MAX_BODY:
            await answer(send, 413, b"The request's body is too large.", [], text=True)
            return
        if not message.get("more_body"):
            break
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    task_id = int(APP_PATH.match(scope["path"])["task_id"])
    headers = [
        *forwarded_headers(scope, token, task_id),
        (b"connection", b"close"),
        (b"content-length", b"%d" % len(body)),
    ]
    client = h11.Connection(h11.CLIENT)
    writer.write(client.send(h11.Request(method=scope["method"], target=target, headers=headers)))
    if body:
        writer.write(client.send(h11.Data(data=bytes(body))))
    writer.write(client.send(h11.EndOfMessage()))
    await writer.drain()
    started = False
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            data = await reader.read(READ)
            client.receive_data(data)
            continue
        if isinstance(event, h11.Response):
            kept = [(n, v) for n, v in event.headers if n.lower() not in HOP_BY_HOP] + cookies
            await send({"type": "http.response.start", "status": event.status_code, "headers": kept})
            started = True
        elif isinstance(event, h11.Data):
            await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    if started:
        await send({"type": "http.response.body", "body": b""})
    else:
        await answer(send, 502, b"The app closed the connection without an answer.", [], text=True)


async def forward_websocket(scope, receive, send, reader, writer, token: str) -> None:
    """The browser's WebSocket, message for message, to a WebSocket opened to the app on
    the relay (the same path, the browser's Host, Origin and subprotocols)."""
    host = header(scope, b"host") or "localhost"
    target = scope.get("raw_path") or scope["path"].encode()
    query = b"?" + scope["query_string"] if scope.get("query_string") else b""
    offered = [p.strip() for p in (header(scope, b"sec-websocket-protocol") or "").split(",") if p.strip()]
    protocol = ClientProtocol(
        parse_uri(f"ws://{host}{(target + query).decode('latin-1')}"),
        origin=header(scope, b"origin"),
        subprotocols=offered or None,
        max_size=MAX_BODY,
    )
    request = protocol.connect()
    request.headers["Authorization"] = f"token {token}"
    protocol.send_request(request)
    await _flush(protocol, writer)
    response, pending = None, []
    while response is None:
        data = await reader.read(READ)
        if not data:
            protocol.receive_eof()
        else:
            protocol.receive_data(data)
        for event in protocol.events_received():
            if isinstance(event, WsResponse):
                response = event
            else:
                pending.append(event)  # frames that came with the handshake's answer
        if not data and response is None:
            break
    if response is None or response.status_code != 101:
        await send({"type": "websocket.close", "code": 4502})
        return
    chosen = Headers(response.headers).get("Sec-WebSocket-Protocol")
    await send({"type": "websocket.accept", **({"subprotocol": chosen} if chosen else {})})

    async def browser_to_app() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                protocol.send_close()
                await _flush(protocol, writer)
                return
            if message.get("text") is not None:
                protocol.send_text(message["text"].encode())
            elif message.get("bytes") is not None:
                protocol.send_binary(message["bytes"])
            await _flush(protocol, writer)

    async def app_to_browser() -> None:
        parts: list[bytes] = []
        opcode = None
        frames = pending
        while True:
            for frame in frames:
                if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                    opcode, parts = frame.opcode, [frame.data]
                elif frame.opcode == Opcode.CONT:
                    parts.append(frame.data)
                elif frame.opcode == Opcode.CLOSE:
                    await _flush(protocol, writer)
                    return
                else:
                    continue  # pings are answered by the protocol itself
                if frame.fin:
                    data = b"".join(parts)
                    if opcode == Opcode.TEXT:
                        await send({"type": "websocket.send", "text": data.decode()})
                    else:
                        await send({"type": "websocket.send", "bytes": data})
            await _flush(protocol, writer)
            data = await reader.read(READ)
            if not data:
                return
            protocol.receive_data(data)
            frames = protocol.events_received()

    try:
        await until_either_ends(browser_to_app(), app_to_browser())
    finally:
        with contextlib.suppress(Exception):
            await send({"type": "websocket.close", "code": 1000})


async def _flush(protocol, writer) -> None:
    for data in protocol.data_to_send():
        if data:
            writer.write(data)
    await writer.drain()
