"""POST/PUT /api/v1/nodes/{id}/heartbeat, served as a thin ASGI route in front of Django.

Every agent calls this every 5 s, so it skips Django's middleware stack and the ORM's
thread hop: it checks the agent key, bounds the body, parses once with orjson,
validates with the compiled schema, and runs `heartbeat.ingest` on a connection from an
async psycopg pool. Everything else goes to Django unchanged.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
import time

import orjson
from django.conf import settings
from psycopg_pool import AsyncConnectionPool

from apps.core.asgi import BodyTooLarge, ClientGone, ThinRoute, header, host_is_allowed, is_secure, read_body, send_json
from apps.core.clock import utcnow
from apps.core.db import check_idle_connection, libpq_params, on_live_connection
from apps.core.enqueue import enqueue
from apps.core.error_codes import CoreErrorCode
from apps.core.errors import error_body
from apps.monitoring.metrics import record_heartbeat, record_ignored_agent_fields
from apps.nodes import heartbeat
from apps.nodes.metrics import PRUNE_EVERY_SECONDS
from apps.nodes.protocol import read_heartbeat

logger = logging.getLogger(__name__)
PATH = re.compile(r"^/api/v1/nodes/(?P<node_id>[^/]+)/heartbeat/?$")
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
LOGGED_SKEWS_MAX = 1_024  # (agent version, field) pairs logged once each, at most this many


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str, fields: dict | None = None, headers=()):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(code, message, fields), list(headers)


def client_address(scope, trusted_proxies) -> str | None:
    """The TCP peer. Forwarded headers count only when the peer is a proxy the operator
    trusts; then the right-most address that is not a trusted proxy is the client."""
    peer = (scope.get("client") or (None, None))[0]
    if peer is None or not trusted_proxies:
        return peer
    try:
        if not any(ipaddress.ip_address(peer) in net for net in trusted_proxies):
            return peer
    except ValueError:
        return peer
    forwarded = header(scope, b"x-forwarded-for")
    for hop in reversed([part.strip() for part in (forwarded or "").split(",") if part.strip()]):
        try:
            address = ipaddress.ip_address(hop)
        except ValueError:
            return peer
        if not any(address in net for net in trusted_proxies):
            return str(address)
    return peer


class HeartbeatApp(ThinRoute):
    def __init__(self, fallback):
        super().__init__(fallback)
        self._pool: AsyncConnectionPool | None = None
        self._pool_loop = None
        self.clock = time.monotonic
        self._prune_asked_at = self.clock()  # beat asks at start-up; this process, a period later
        self._logged_skews: set[tuple[str, str]] = set()
        self._trusted = [ipaddress.ip_network(net, strict=False) for net in settings.HETEROFLOW_TRUSTED_PROXIES]

    def match(self, scope) -> str | None:
        found = PATH.match(scope["path"])
        return found["node_id"] if found else None

    async def pool(self) -> AsyncConnectionPool:
        loop = asyncio.get_running_loop()
        if self._pool is None or self._pool_loop is not loop:
            self._pool = AsyncConnectionPool(
                kwargs=libpq_params(autocommit=True),
                min_size=1,
                max_size=settings.HETEROFLOW_HEARTBEAT_DB_POOL_SIZE,
                open=False,
                timeout=5.0,
                # a connection the database ended (a restart, a terminated backend) is
                # found and replaced when taken, never handed to a beat to fail on
                check=check_idle_connection,
            )
            await self._pool.open()
            self._pool_loop = loop
        return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def handle(self, scope, receive, send, node_id: str) -> None:
        try:
            status, body = await self.respond(scope, receive, node_id)
            headers = []
        except HttpError as exc:
            status, body, headers = exc.status, exc.body, exc.headers
        record_heartbeat(status, body.get("error", {}).get("code"))
        await send_json(send, status, body, headers)

    async def respond(self, scope, receive, node_id: str) -> tuple[int, dict]:
        # What Django's middleware would do for any other endpoint: the host check and
        # the HTTPS redirect (the agent key must not travel in clear in production).
        host = header(scope, b"host") or ""
        if not host_is_allowed(scope):
            raise HttpError(400, CoreErrorCode.BAD_REQUEST, f"Invalid HTTP_HOST header: {host!r}.")
        if settings.SECURE_SSL_REDIRECT and not is_secure(scope):
            location = f"https://{host}{scope['path']}".encode()
            raise HttpError(301, CoreErrorCode.HTTPS_REQUIRED, "Use HTTPS.", headers=[(b"location", location)])
        if scope["method"] not in ("POST", "PUT"):
            raise HttpError(
                405,
                CoreErrorCode.METHOD_NOT_ALLOWED,
                f'Method "{scope["method"]}" not allowed.',
                headers=[(b"allow", b"POST, PUT")],
            )
        await self.authenticate(scope)
        if not NODE_ID.match(node_id):
            raise HttpError(
                400,
                CoreErrorCode.INVALID,
                "Invalid node id.",
                {"node_id": ["1-128 characters: letters, digits, '.', '_', ':', '-'."]},
            )
        payload = orjson_or_400(await beat_body(scope, receive))
        if not isinstance(payload, dict):
            raise HttpError(400, CoreErrorCode.INVALID, "A heartbeat is a JSON object.")
        if payload.get("node_id", node_id) != node_id:
            raise HttpError(
                400,
                CoreErrorCode.INVALID,
                "node_id in the body differs from the path.",
                {"node_id": ["Must match the path."]},
            )
        errors, ignored = read_heartbeat(payload)
        if errors:
            raise HttpError(400, CoreErrorCode.INVALID, "Invalid heartbeat: " + ", ".join(sorted(errors)) + ".", errors)
        if ignored:
            self.note_ignored(payload.get("agent_version", ""), ignored)
        now = utcnow()
        try:
            outcome = await self.ingest(node_id, payload, client_address(scope, self._trusted), now)
        except Exception:
            # Never guess: a beat that could not be applied writes nothing and says so.
            logger.exception("heartbeat of %s not applied", node_id)
            raise HttpError(503, CoreErrorCode.UNAVAILABLE, "The heartbeat could not be recorded; retry.") from None
        self.after_beat()
        return 200, {
            "node_id": node_id,
            "status": outcome.status,
            "registered": outcome.registered,
            # ids of the tasks waiting for this node; the agent fetches and claims them
            # on its task channel (GET /api/v1/tasks?node_id=&status=scheduled)
            "scheduled_tasks": outcome.scheduled_task_ids,
            "server_time": now.isoformat().replace("+00:00", "Z"),
        }

    async def ingest(self, node_id: str, payload: dict, peer: str | None, now) -> heartbeat.BeatOutcome:
        """The beat on a pooled connection. A connection the database ended (a restart, a
        terminated backend) is found when taken (the pool's check) or, when its farewell
        had not arrived yet, by the beat's first statement failing on it: then nothing of
        the beat was committed, and it runs once more on another connection."""
        return await on_live_connection(
            await self.pool(), lambda conn: heartbeat.ingest(conn, node_id, payload, peer, now)
        )

    async def authenticate(self, scope) -> None:
        offered = header(scope, b"x-api-key")
        expected = settings.HETEROFLOW_AGENT_SECRET or ""
        if offered is None:
            if header(scope, b"authorization"):
                raise HttpError(403, CoreErrorCode.PERMISSION_DENIED, "Heartbeats take the agent key (X-API-Key).")
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

    def note_ignored(self, agent_version: str, fields: list[str]) -> None:
        """Fields this server does not know, from an agent newer than it: counted in a
        metric, and logged once per agent version and field (not on every beat)."""
        record_ignored_agent_fields("heartbeat", fields)
        new = [name for name in fields if (agent_version, name) not in self._logged_skews]
        if new and len(self._logged_skews) < LOGGED_SKEWS_MAX:
            self._logged_skews.update((agent_version, name) for name in new)
            logger.warning(
                "agent %s sends heartbeat fields this server does not know, ignored: %s "
                "(an agent newer than the server? upgrade the server)",
                agent_version or "(no version)",
                ", ".join(new),
            )

    def after_beat(self) -> None:
        """Ask for the metrics retention job once per its period from this process (beat
        drives it too; the guard keeps it to one run per period whoever asks). The
        request talks to Redis, so it runs in a thread, off the event loop: a slow or
        absent Redis must never hold heartbeats up."""
        now = self.clock()
        if now - self._prune_asked_at >= PRUNE_EVERY_SECONDS:
            self._prune_asked_at = now
            asyncio.get_running_loop().run_in_executor(None, enqueue, "nodes.prune_metrics")


def orjson_or_400(body: bytes):
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HttpError(400, CoreErrorCode.PARSE_ERROR, f"JSON parse error - {exc}") from None


async def beat_body(scope, receive) -> bytes:
    try:
        return await read_body(scope, receive, settings.HETEROFLOW_HEARTBEAT_MAX_BYTES)
    except BodyTooLarge as exc:
        raise HttpError(
            413, CoreErrorCode.PAYLOAD_TOO_LARGE, f"A heartbeat may be at most {exc.limit} bytes."
        ) from None
    except ClientGone:
        raise HttpError(400, CoreErrorCode.PARSE_ERROR, "The client went away.") from None
