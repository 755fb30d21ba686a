"""POST/PUT /api/v1/nodes/{id}/heartbeat, served as a thin ASGI route in front of Django.

Every agent calls this every 5 s, so it skips Django's middleware stack and the ORM's
thread hop: it checks the agent key, bounds the body, parses once with orjson,
validates with the compiled schema, and runs `heartbeat.ingest` on a connection from an
async psycopg pool. Everything else goes to Django unchanged.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time

from django.conf import settings

from apps.core.asgi import header
from apps.core.clock import utcnow
from apps.core.db import on_live_connection
from apps.core.enqueue import enqueue
from apps.core.error_codes import CoreErrorCode
from apps.monitoring.metrics import record_heartbeat, record_ignored_agent_fields
from apps.nodes import heartbeat
from apps.nodes.api.agent_route import AgentRoute, HttpError, orjson_or_400
from apps.nodes.metrics import PRUNE_EVERY_SECONDS
from apps.nodes.protocol import read_heartbeat

logger = logging.getLogger(__name__)
PATH = re.compile(r"^/api/v1/nodes/(?P<node_id>[^/]+)/heartbeat/?$")
LOGGED_SKEWS_MAX = 1_024  # (agent version, field) pairs logged once each, at most this many


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


class HeartbeatApp(AgentRoute):
    path = PATH
    methods = ("POST", "PUT")
    what = "a heartbeat"

    def __init__(self, fallback):
        super().__init__(fallback)
        self.clock = time.monotonic
        self._prune_asked_at = self.clock()  # beat asks at start-up; this process, a period later
        self._logged_skews: set[tuple[str, str]] = set()
        self._trusted = [ipaddress.ip_network(net, strict=False) for net in settings.HETEROFLOW_TRUSTED_PROXIES]

    def pool_size(self) -> int:
        return settings.HETEROFLOW_HEARTBEAT_DB_POOL_SIZE

    def server_settings(self) -> dict:
        # A beat is telemetry that the node's next beat writes again: committed without
        # waiting for its WAL to reach the disk, a beat is answered without an fsync, and
        # a database crash loses at most the last few hundred milliseconds of beats, each
        # whole (a transaction is kept or lost as one), as if they had not arrived; the
        # next beats redo them, the slow path and the alerts included (docs/nodes.md).
        return {"synchronous_commit": settings.HETEROFLOW_HEARTBEAT_SYNCHRONOUS_COMMIT}

    def body_limit(self) -> int:
        return settings.HETEROFLOW_HEARTBEAT_MAX_BYTES

    def record(self, status: int, body: dict) -> None:
        record_heartbeat(status, body.get("error", {}).get("code"))

    async def respond(self, scope, receive, node_id: str) -> tuple[int, dict]:
        self.check_request(scope, node_id)
        payload = orjson_or_400(await self.body(scope, receive))
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
        # A card known only by its position is left out: which card went cannot be told, so
        # neither can which tasks were on it (the GPU_LOST alert says so).
        lost = [[change.index, change.basis] for change in outcome.gpu_changes if change.lost and change.identified]
        if lost:  # rare: a trace on the cards' tasks, written by a job off the loop
            asyncio.get_running_loop().run_in_executor(None, enqueue, "nodes.record_card_losses", node_id, lost)
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
