"""What the gateway's request path knows, without the ORM: endpoint keys (with their
tenant's limits) and each tenant's routes (model name → services → healthy replicas),
read with plain SQL on an async psycopg pool and cached in the process.

Freshness:
- a change made through apps.gateway.services calls `changed()`: once the transaction
  commits, this process drops its caches and a version counter in Redis is bumped, which
  every other process reads at most every HETEROFLOW_GATEWAY_CACHE_CHECK_SECONDS;
- keys are also read again after HETEROFLOW_GATEWAY_KEYS_TTL_SECONDS, routes and backends
  after HETEROFLOW_GATEWAY_BACKENDS_TTL_SECONDS (replica health comes from the
  heartbeats, every few seconds);
- a backend that refused a connection is left out for HETEROFLOW_GATEWAY_QUARANTINE_SECONDS
  (`quarantine`), at once, in this process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import transaction
from psycopg import sql
from psycopg_pool import AsyncConnectionPool
from redis import asyncio as aioredis

from apps.core.db import check_idle_connection, libpq_params, on_live_connection
from apps.core.redis import client as redis_client
from apps.gateway.external import normal_base
from apps.scheduler.ledger import card_share_sql

logger = logging.getLogger(__name__)

VERSION_KEY = "hf:gw:catalog:version"
REDIS_TIMEOUT = 2.0  # seconds a Redis call on the request path may take
APPLICATION_NAME = "heteroflow-gateway"  # the pool's connections in pg_stat_activity
_generation = 0  # bumped in this process by every committed change


def changed() -> None:
    """A key, a limit or a route changed: every gateway process must read again. Call
    inside the change's transaction; nothing happens if it rolls back."""
    transaction.on_commit(_announce)


def _announce() -> None:
    global _generation
    _generation += 1
    try:
        redis_client().incr(VERSION_KEY)
    except Exception:  # Redis holds nothing that cannot be lost: the TTLs catch up
        logger.warning("could not announce a gateway change; other processes see it within their TTL")


# The platform's largest limit per key, by the key's field (None: no maximum).
KEY_MAX_SETTINGS = {
    "rpm_limit": "HETEROFLOW_GATEWAY_KEY_MAX_RPM",
    "tpm_limit": "HETEROFLOW_GATEWAY_KEY_MAX_TPM",
    "concurrency_limit": "HETEROFLOW_GATEWAY_KEY_MAX_CONCURRENCY",
}


def held_key_limit(own: int | None, field: str) -> int | None:
    """A key's limit as admission holds it: its own, at most the platform's per-key
    maximum (which is also the limit of a key with none of its own)."""
    most = getattr(settings, KEY_MAX_SETTINGS[field])
    if most is None:
        return own
    return most if own is None else min(own, most)


@dataclass(frozen=True)
class KeyInfo:
    id: int
    tenant_id: int
    tenant_slug: str
    name: str
    allowed_models: frozenset[str]  # empty: all
    # the key's limits as admission holds them (held_key_limit); the tenant's below
    rpm_limit: int | None
    tpm_limit: int | None
    concurrency_limit: int | None
    expires_at: datetime | None
    revoked: bool
    grace_until: datetime | None  # set when the secret offered is the previous one
    tenant_rpm_limit: int | None
    tenant_tpm_limit: int | None
    tenant_concurrency_limit: int | None

    def refusal(self, now: datetime) -> str | None:
        """Why this key cannot be used now, or None."""
        if self.revoked:
            return "This API key was revoked."
        if self.expires_at is not None and self.expires_at <= now:
            return "This API key has expired."
        if self.grace_until is not None and self.grace_until <= now:
            return "This API key was rotated and its old secret is no longer valid."
        return None

    def may_call(self, model: str) -> bool:
        return not self.allowed_models or model in self.allowed_models


@dataclass(frozen=True)
class Backend:
    task_id: int
    address: str  # http://ip:port
    healthy: bool = True
    cards: float = 0.0  # the GPUs the replica holds (a share of one: its fraction); external: 0


@dataclass(frozen=True)
class Service:
    id: int
    model: str
    state: str
    backends: tuple[Backend, ...] = field(default=())  # every running replica with an address
    priority: int = 0
    weight: int = 100
    auth: str | None = None  # an external backend's bearer token

    @property
    def external(self) -> bool:
        """An operator-declared external backend (its id is minus the backend's id)."""
        return self.id < 0

    def usable_backends(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def cards_of(self, backend_address: str) -> float:
        """The GPUs the replica at this address holds (0 for one this service does not name)."""
        for backend in self.backends:
            if backend.address == backend_address:
                return backend.cards
        return 0.0


KEY_SQL = """
SELECT k.id, k.tenant_id, t.slug, k.name, k.allowed_models, k.rpm_limit, k.tpm_limit, k.concurrency_limit,
       k.expires_at, k.revoked_at IS NOT NULL, CASE WHEN k.key_hash = %(h)s THEN NULL ELSE k.previous_valid_until END,
       l.rpm_limit, l.tpm_limit, l.concurrency_limit
FROM gateway_endpoint_keys k
JOIN tenants t ON t.id = k.tenant_id
LEFT JOIN gateway_tenant_limits l ON l.tenant_id = k.tenant_id
WHERE k.key_hash = %(h)s OR k.previous_key_hash = %(h)s
LIMIT 1
"""

# The replicas of a tenant's services: every running task with a host port on a node
# with an address; it is healthy when the node's latest heartbeat says its probe passed
# (Node.task_health). Stickiness hashes over all of them, balancing uses the healthy ones.
# Its cards (the GPU-seconds' rate, apps.gateway.usage.ShareClock) are what the GPU ledger
# says it holds, by the ledger's own share rule (apps.scheduler.ledger.HELD_ENERGY): a
# whole card 1, a share its memory / the card's, at most 1, the whole card where the
# card's size is unknown; a replica the ledger has no row for (not bound through the
# scheduler) counts what it asked for, a share as the whole card.
ROUTES_SQL = f"""
SELECT s.group_id, m.name, s.state, COALESCE(r.priority, 0), COALESCE(r.weight, 100),
       t.id, t.host_port, host(COALESCE(n.ip, n.internal_ip)),
       EXISTS (SELECT 1 FROM jsonb_array_elements(
                 CASE WHEN jsonb_typeof(n.task_health) = 'array' THEN n.task_health ELSE '[]'::jsonb END) h
               WHERE h->>'task_id' = t.id::text AND h->>'healthy' = 'true'),
       COALESCE(
         (SELECT sum({card_share_sql("a", "g")})
          FROM gpu_allocations a LEFT JOIN gpus g ON g.node_id = a.node_id AND g.index = a.gpu_index
          WHERE a.task_id = t.id),
         CASE WHEN t.gpu_required > 0 THEN t.gpu_required WHEN t.gpu_memory_mb IS NOT NULL THEN 1 ELSE 0 END
       )::float8
FROM inference_services s
JOIN task_groups g ON g.id = s.group_id
JOIN inference_models m ON m.id = s.model_id
LEFT JOIN gateway_service_routes r ON r.service_id = s.group_id
LEFT JOIN tasks t ON t.group_id = s.group_id AND t.status = 'running' AND t.host_port IS NOT NULL
LEFT JOIN nodes n ON n.id = t.node_id
WHERE g.tenant_id = %s
ORDER BY s.group_id, t.rank
"""

EXTERNAL_SQL = """
SELECT e.id, e.model, e.base_url, e.secret_name, e.priority, e.weight, t.schema_name
FROM gateway_external_backends e JOIN tenants t ON t.id = e.tenant_id
WHERE e.tenant_id = %s AND e.enabled
ORDER BY e.id
"""

LAST_REQUEST_SQL = """
UPDATE inference_services s SET last_request_at = v.at
FROM unnest(%s::bigint[], %s::timestamptz[]) AS v(id, at)
WHERE s.group_id = v.id AND (s.last_request_at IS NULL OR s.last_request_at < v.at)
"""

LAST_USED_SQL = """
UPDATE gateway_endpoint_keys k SET last_used_at = v.at
FROM unnest(%s::bigint[], %s::timestamptz[]) AS v(id, at)
WHERE k.id = v.id AND (k.last_used_at IS NULL OR k.last_used_at < v.at)
"""


def address(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


def services_from_rows(rows) -> dict[str, list[Service]]:
    """Model name → the services serving it, each with its replicas."""
    by_id: dict[int, tuple] = {}
    for service_id, model, state, priority, weight, task_id, port, ip, healthy, cards in rows:
        entry = by_id.setdefault(service_id, (model, state, priority, weight, []))
        if task_id is not None and ip is not None:
            entry[4].append(Backend(task_id, address(ip, port), bool(healthy), cards or 0.0))
    routes: dict[str, list[Service]] = {}
    for service_id, (model, state, priority, weight, backends) in by_id.items():
        routes.setdefault(model, []).append(Service(service_id, model, state, tuple(backends), priority, weight))
    return routes


class Catalog:
    """One per process and event loop: the pool, the Redis client, the caches."""

    def __init__(self):
        self._pool: AsyncConnectionPool | None = None
        self._redis = None
        self._loop = None
        self._keys: dict[str, tuple[float, KeyInfo | None]] = {}
        self._routes: dict[int, tuple[float, dict[str, list[Service]]]] = {}
        self._quarantine: dict[str, float] = {}
        self._refreshing: set[int] = set()
        self._cleared = 0
        self._generation = _generation
        self._version: bytes | None = None
        self._version_checked = 0.0
        self._lock = asyncio.Lock()
        self.redis_away = False  # set by the gateway while Redis does not answer

    # --- connections -------------------------------------------------------------------

    async def _ensure(self):
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._pool = AsyncConnectionPool(
                kwargs=libpq_params(autocommit=True, application_name=APPLICATION_NAME),
                min_size=1,
                max_size=settings.HETEROFLOW_GATEWAY_DB_POOL_SIZE,
                open=False,
                timeout=5.0,
                # a connection the server ended (a restart, pg_terminate_backend, an idle
                # timeout) is found out before it is lent, not by the request that gets
                # it, without a round trip (as the heartbeat's pool)
                check=check_idle_connection,
            )
            await self._pool.open()
            # No socket_timeout: redis-py wraps every read in asyncio.wait_for for it (a task
            # per command, a third of the gateway's Redis cost); callers bound their calls
            # with asyncio.timeout instead (REDIS_TIMEOUT).
            self._redis = aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, max_connections=256)
            self._loop = loop
            self._lock = asyncio.Lock()

    async def redis(self):
        await self._ensure()
        return self._redis

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
        self._loop = None

    async def fetch(self, sql: str, params) -> list[tuple]:
        """A read; on a connection the database ended just now it is read again on another."""
        await self._ensure()

        async def read(conn):
            cursor = await conn.execute(sql, params, prepare=True)
            return await cursor.fetchall()

        return await on_live_connection(self._pool, read)

    async def execute(self, sql: str, params) -> None:
        await self._ensure()
        async with self._pool.connection() as conn:
            await conn.execute(sql, params)

    # --- freshness ---------------------------------------------------------------------

    def clear(self) -> None:
        self._cleared += 1
        self._keys.clear()
        self._routes.clear()

    async def fresh(self) -> None:
        """Drop the caches when a change was committed here or announced elsewhere."""
        if self._generation != _generation:
            self._generation = _generation
            self.clear()
        now = time.monotonic()
        if now - self._version_checked < settings.HETEROFLOW_GATEWAY_CACHE_CHECK_SECONDS:
            return
        self._version_checked = now
        if self.redis_away:
            return  # the caches live their TTL until Redis is back
        try:
            async with asyncio.timeout(REDIS_TIMEOUT):
                version = await (await self.redis()).get(VERSION_KEY)
        except Exception:
            logger.warning("could not read the gateway's change counter; caches live their TTL")
            return
        if version != self._version:
            self._version = version
            self.clear()

    # --- reads -------------------------------------------------------------------------

    async def key(self, key_hash: str) -> KeyInfo | None:
        now = time.monotonic()
        cached = self._keys.get(key_hash)
        if cached is not None and cached[0] > now:
            return cached[1]
        rows = await self.fetch(KEY_SQL, {"h": key_hash})
        info = None
        if rows:
            row = rows[0]
            info = KeyInfo(
                id=row[0],
                tenant_id=row[1],
                tenant_slug=row[2],
                name=row[3],
                allowed_models=frozenset(row[4] or ()),
                rpm_limit=held_key_limit(row[5], "rpm_limit"),
                tpm_limit=held_key_limit(row[6], "tpm_limit"),
                concurrency_limit=held_key_limit(row[7], "concurrency_limit"),
                expires_at=row[8],
                revoked=row[9],
                grace_until=row[10],
                tenant_rpm_limit=row[11],
                tenant_tpm_limit=row[12],
                tenant_concurrency_limit=row[13],
            )
        if len(self._keys) > 100_000:  # unknown keys offered in a flood must not grow it forever
            self._keys.clear()
        self._keys[key_hash] = (now + settings.HETEROFLOW_GATEWAY_KEYS_TTL_SECONDS, info)
        return info

    async def routes(self, tenant_id: int) -> dict[str, list[Service]]:
        """The tenant's routes. Past their TTL they are still served while one refresh
        runs in the background (no herd of requests reading the same rows at once); only
        a tenant not cached at all (or dropped by a change) waits for the read."""
        now = time.monotonic()
        cached = self._routes.get(tenant_id)
        if cached is not None:
            if cached[0] <= now and tenant_id not in self._refreshing:
                self._refreshing.add(tenant_id)
                asyncio.get_running_loop().create_task(self._refresh(tenant_id))
            return cached[1]
        return await self._load_routes(tenant_id)

    async def _refresh(self, tenant_id: int) -> None:
        try:
            await self._load_routes(tenant_id)
        except Exception:
            logger.warning("could not refresh the routes of tenant %s; serving the last ones", tenant_id, exc_info=True)
        finally:
            self._refreshing.discard(tenant_id)

    async def _load_routes(self, tenant_id: int) -> dict[str, list[Service]]:
        generation = self._cleared
        routes = services_from_rows(await self.fetch(ROUTES_SQL, (tenant_id,)))
        for backend_id, model, base_url, secret_name, priority, weight, schema in await self.fetch(
            EXTERNAL_SQL, (tenant_id,)
        ):
            auth = await self.secret(schema, secret_name) if secret_name else None
            routes.setdefault(model, []).append(
                Service(-backend_id, model, "running", (Backend(0, normal_base(base_url)),), priority, weight, auth)
            )
        if generation == self._cleared:  # not read before a change that dropped the caches meanwhile
            self._routes[tenant_id] = (time.monotonic() + settings.HETEROFLOW_GATEWAY_BACKENDS_TTL_SECONDS, routes)
        return routes

    async def secret(self, schema: str, name: str) -> str | None:
        """A tenant secret's value, read from the tenant's own schema."""
        query = sql.SQL("SELECT value FROM {}.secrets WHERE name = %s").format(sql.Identifier(schema))
        rows = await self.fetch(query, (name,))
        return rows[0][0] if rows else None

    def forget_routes(self, tenant_id: int) -> None:
        self._routes.pop(tenant_id, None)

    # --- backends out of rotation ------------------------------------------------------

    def quarantine(self, backend_address: str, seconds: float | None = None) -> None:
        until = time.monotonic() + (settings.HETEROFLOW_GATEWAY_QUARANTINE_SECONDS if seconds is None else seconds)
        self._quarantine[backend_address] = max(until, self._quarantine.get(backend_address, 0.0))

    def release(self, backend_address: str) -> None:
        """A backend that answered its probe is back in rotation at once."""
        self._quarantine.pop(backend_address, None)

    def known_backends(self) -> set[str]:
        """Every replica address of the routes this process holds (the tenants it served lately)."""
        return {
            b.address
            for _, routes in self._routes.values()
            for services in routes.values()
            for service in services
            for b in service.backends
        }

    def clean(self, older_than: float) -> None:
        """Drop cached routes not read again for `older_than` seconds, expired keys and
        quarantine entries: what a long-running process would otherwise keep forever."""
        now = time.monotonic()
        for tenant_id in [t for t, (until, _) in self._routes.items() if until < now - older_than]:
            del self._routes[tenant_id]
        for key_hash in [h for h, (until, _) in self._keys.items() if until < now]:
            del self._keys[key_hash]
        for address in [a for a, until in self._quarantine.items() if until <= now]:
            del self._quarantine[address]

    def usable(self, backends) -> list[Backend]:
        if not self._quarantine:
            return list(backends)
        now = time.monotonic()
        for stale in [a for a, until in self._quarantine.items() if until <= now]:
            del self._quarantine[stale]
        return [b for b in backends if b.address not in self._quarantine]
