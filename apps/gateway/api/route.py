"""The OpenAI-compatible endpoints, served as a thin ASGI route in front of Django:
POST /v1/chat/completions, /v1/completions, /v1/embeddings; GET /v1/models (and
/v1/models/{id}).

A hot path like the heartbeat: no Django middleware, no ORM. The endpoint key, the
tenant's routes and the replicas come from the catalog (plain SQL on an async pool,
cached, dropped on change); limits, connection counts and the services' signals are one
Redis script call to admit a request and one to release it (while Redis is away, this
process's share of the limits: HETEROFLOW_GATEWAY_LIMITS_WITHOUT_REDIS, docs/gateway.md);
the body goes to the backend unchanged on a pooled async HTTP client (aiohttp: about ten
times httpx's rate here, see docs/gateway.md), and the answer comes back unchanged: a
stream chunk by chunk as the backend sends it (with back-pressure: the next chunk is
read once the client took the last), anything else whole. Only `model`, `stream`,
`user`, `prompt_cache_key` and `messages` are read from the body, and `usage` from the
answer.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the
statuses the OpenAI client expects: 400 bad body, 401 bad, revoked or expired key (or a
key that is not an endpoint key), 403 a model the key may not call, 404 unknown model,
429 with Retry-After (the window's reset), 502 the backend failed, 503 no healthy
backend (with Retry-After while a sleeping service wakes), 504 the backend timed out.

A request whose connection is refused is retried once on another backend; never once
the backend answered (the request may have run). A client that goes away cancels the
upstream request, and every count taken for it is given back on every exit path.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from datetime import UTC, datetime
from itertools import count

import aiohttp
import orjson
import psycopg
from django.conf import settings
from django.db import connection
from redis.exceptions import RedisError

from apps.core.asgi import header, host_is_allowed, is_secure
from apps.core.enqueue import enqueue
from apps.gateway import keys, routing
from apps.gateway import services as gateway_services
from apps.gateway.catalog import REDIS_TIMEOUT, Catalog, KeyInfo, Service
from apps.gateway.choices import Balancer
from apps.gateway.error_codes import GatewayErrorCode
from apps.gateway.limits import (
    PROCESS_BEAT_SECONDS,
    PROCESSES_KEY,
    Admission,
    Limits,
    LocalLimits,
    count_processes,
    retry_after,
)
from apps.gateway.usage import Meter, usage_of_body, usage_of_stream
from apps.monitoring.metrics import record_gateway_request, record_gateway_tokens, record_gateway_without_redis

logger = logging.getLogger(__name__)

POST_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
MODELS_PATH = "/v1/models"
WAKE_EVERY_SECONDS = 5.0
PROBE_EVERY_SECONDS = 10.0  # the gateway's own probe of the replicas it routes to
PROBE_TIMEOUT_SECONDS = 2.0
PROBE_PATHS = ("/health", "/v1/models")  # the engines' health endpoint, else the models list
CLEAN_EVERY_SECONDS = 300.0  # stale cache entries dropped
REDIS_AWAY_RETRY_SECONDS = 1.0  # how often a process asks whether Redis is back
TENANT_KEY_PREFIXES = ("sk-tenant-", "sk-admin-")
FORWARDED_REQUEST_HEADERS = (b"content-type", b"accept")
DROPPED_RESPONSE_HEADERS = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"server", b"date"}
)


class GatewayError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, headers=(), param=None):
        super().__init__(message)
        self.status, self.headers, self.code = status, list(headers), code
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}


def unauthorized(message: str, code: str = GatewayErrorCode.INVALID_API_KEY) -> GatewayError:
    return GatewayError(
        401, message, "authentication_error", code, [(b"www-authenticate", b'Bearer realm="heteroflow"')]
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", code, param=param)


def unavailable(
    message: str, retry: int | None = None, code: str = GatewayErrorCode.NO_HEALTHY_BACKEND
) -> GatewayError:
    headers = [(b"retry-after", str(retry).encode())] if retry else []
    return GatewayError(503, message, "service_unavailable", code, headers)


def backend_failed(exc: BaseException, outcome, when: str) -> GatewayError:
    """A backend that timed out (504) or failed (502), `when` it did ("" or " mid-answer")."""
    outcome.error = True
    if isinstance(exc, TimeoutError):
        return GatewayError(
            504, "The model's backend did not answer in time.", "server_error", GatewayErrorCode.BACKEND_TIMEOUT
        )
    return GatewayError(
        502, f"The model's backend failed{when} ({type(exc).__name__}).", "server_error", GatewayErrorCode.BACKEND_ERROR
    )


class GatewayApp:
    """/v1/* answered here; everything else goes to `fallback` (Django)."""

    def __init__(self, fallback, *, catalog: Catalog | None = None):
        self.fallback = fallback
        self.catalog = catalog or Catalog()
        self.meter = Meter(self.catalog)
        self._client: aiohttp.ClientSession | None = None
        self._client_loop = None
        self._limits: Limits | None = None
        self._limits_redis = None
        self._turns = count()
        self._woken: dict[int, float] = {}
        self._prober: asyncio.Task | None = None
        self._keeper: asyncio.Task | None = None
        self._flusher: asyncio.Task | None = None
        self.balancer = settings.HETEROFLOW_GATEWAY_BALANCER
        self.stickiness = settings.HETEROFLOW_GATEWAY_STICKINESS
        self.process_id = uuid.uuid4().hex  # this process among the live gateway processes
        self.local = LocalLimits()
        self.without_redis = settings.HETEROFLOW_GATEWAY_LIMITS_WITHOUT_REDIS
        if self.without_redis == "open":
            logger.warning(
                "HETEROFLOW_GATEWAY_LIMITS_WITHOUT_REDIS=open: while Redis is away the gateway admits every "
                "request with no rate, token or concurrency limit"
            )

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            path = scope["path"]
            if path in POST_PATHS or path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
                await self.handle(scope, receive, send)
                return
        elif scope["type"] == "lifespan":
            await self.lifespan(receive, send)
            return
        await self.fallback(scope, receive, send)

    async def lifespan(self, receive, send) -> None:
        """The ASGI lifespan (the apps behind this one, Django's included, take none): the
        background tasks start with the process; at shutdown, after the last request
        ended (uvicorn waits for them on SIGTERM), the usage gathered is written."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start_background()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                try:
                    await self.close()
                except Exception:
                    logger.exception("the gateway did not close cleanly")
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- clients -----------------------------------------------------------------------

    def client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=settings.HETEROFLOW_GATEWAY_MAX_CONNECTIONS,
                    limit_per_host=0,
                    # below the engines' own idle keep-alive (uvicorn's, llama.cpp's: 5 s), so a
                    # pooled connection is never one the replica is closing as it is reused
                    keepalive_timeout=4.0,
                    ttl_dns_cache=60,
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=settings.HETEROFLOW_GATEWAY_CONNECT_TIMEOUT_SECONDS,
                    sock_connect=settings.HETEROFLOW_GATEWAY_CONNECT_TIMEOUT_SECONDS,
                    sock_read=settings.HETEROFLOW_GATEWAY_FIRST_BYTE_TIMEOUT_SECONDS,
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                trust_env=False,
            )
            self._client_loop = loop
        return self._client

    async def limits(self) -> Limits:
        redis = await self.catalog.redis()
        if self._limits is None or self._limits_redis is not redis:
            self._limits = Limits(redis, settings.HETEROFLOW_GATEWAY_CONCURRENCY_TTL_SECONDS)
            self._limits_redis = redis
        return self._limits

    # --- the backends' health -------------------------------------------------------------

    def start_background(self) -> None:
        """The probe of the replicas, the count of the gateway processes (and the watch
        on Redis) and the usage flush, each a task on this loop."""
        loop = asyncio.get_running_loop()

        def started(task, body):
            if task is None or task.done() or task.get_loop() is not loop:
                return loop.create_task(body())
            return task

        self._prober = started(self._prober, self.probe_forever)
        self._keeper = started(self._keeper, self.keep_forever)
        self._flusher = started(self._flusher, self.flush_forever)

    async def flush_forever(self) -> None:
        """Usage is written at least every HETEROFLOW_GATEWAY_FLUSH_SECONDS, requests or
        not: a process killed loses at most that long's worth."""
        while True:
            await asyncio.sleep(settings.HETEROFLOW_GATEWAY_FLUSH_SECONDS)
            if self.meter.pending():
                await self.meter.flush()

    # --- Redis away ----------------------------------------------------------------------

    async def keep_forever(self) -> None:
        """Every PROCESS_BEAT_SECONDS: say this process is alive and count the gateway
        processes (the divisor of the limits while Redis is away). Once Redis does not
        answer (here or on a request), ask every second whether it is back."""
        while True:
            try:
                async with asyncio.timeout(REDIS_TIMEOUT):
                    divisor = await count_processes(await self.catalog.redis(), self.process_id, time.time())
            except Exception:
                self.redis_lost()
            else:
                self.local.divisor = divisor
                self.redis_returned()
            self.local.clean(time.time())
            await asyncio.sleep(REDIS_AWAY_RETRY_SECONDS if self.catalog.redis_away else PROCESS_BEAT_SECONDS)

    def redis_lost(self) -> None:
        if self.catalog.redis_away:
            return
        self.catalog.redis_away = True
        logger.error(
            "Redis is away: the gateway's limits are now %s (HETEROFLOW_GATEWAY_LIMITS_WITHOUT_REDIS), "
            "%s gateway process(es) last counted",
            self.without_redis,
            self.local.divisor,
        )
        asyncio.get_running_loop().run_in_executor(None, in_thread, gateway_services.redis_away, self.without_redis)

    def redis_returned(self) -> None:
        if not self.catalog.redis_away:
            return
        self.catalog.redis_away = False
        logger.warning("Redis is back: the gateway's limits are shared again")
        asyncio.get_running_loop().run_in_executor(None, in_thread, gateway_services.redis_back)

    def admit_without_redis(self, key: KeyInfo, now: float) -> Admission:
        if self.without_redis == "closed":
            record_gateway_without_redis("closed", admitted=False)
            raise unavailable(
                "The gateway cannot check this key's limits right now; retry shortly.",
                retry=5,
                code=GatewayErrorCode.LIMITS_UNAVAILABLE,
            )
        if self.without_redis == "open":
            self.local.started(key, now)
            admission = Admission(True)
        else:
            admission = self.local.admit(key, now)
        record_gateway_without_redis(self.without_redis, admission.admitted)
        return admission

    async def probe_forever(self) -> None:
        cleaned = time.monotonic()
        while True:
            await asyncio.sleep(PROBE_EVERY_SECONDS)
            try:
                await self.probe_once()
                if time.monotonic() - cleaned >= CLEAN_EVERY_SECONDS:
                    cleaned = time.monotonic()
                    self.catalog.clean(CLEAN_EVERY_SECONDS)
            except Exception:
                logger.warning("the gateway's backend probe failed", exc_info=True)

    async def probe_once(self) -> dict[str, bool]:
        """Probe every replica of the routes this process holds: one that does not answer
        (or answers 5xx) is out of rotation until the next probe says otherwise; one that
        answers is back at once."""
        addresses = sorted(self.catalog.known_backends())
        results = await asyncio.gather(*(self.probe(address) for address in addresses))
        for address, ok in zip(addresses, results, strict=True):
            if ok:
                self.catalog.release(address)
            else:
                self.catalog.quarantine(address, PROBE_EVERY_SECONDS + PROBE_TIMEOUT_SECONDS)
        return dict(zip(addresses, results, strict=True))

    async def probe(self, address: str) -> bool:
        client = self.client()
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_SECONDS)
        for path in PROBE_PATHS:
            try:
                async with client.get(address + path, timeout=timeout, allow_redirects=False) as response:
                    if response.status == 404:
                        continue  # no such endpoint on this engine: try the next
                    return response.status < 500
            except (aiohttp.ClientError, TimeoutError):
                return False
        return False

    async def close(self) -> None:
        for task in (self._prober, self._keeper, self._flusher):
            if task is not None:
                task.cancel()
        self._prober = self._keeper = self._flusher = None
        await self.meter.flush()
        if self.catalog._redis is not None and not self.catalog.redis_away:
            try:  # no longer one of the live processes
                async with asyncio.timeout(REDIS_TIMEOUT):
                    await self.catalog._redis.zrem(PROCESSES_KEY, self.process_id)
            except Exception:
                logger.info("could not leave the gateway processes' count; it forgets this one in 15 s")
        if self._client is not None:
            await self._client.close()
            self._client = None
        await self.catalog.close()

    # --- the request -------------------------------------------------------------------

    async def handle(self, scope, receive, send) -> None:
        timing = Timing(send)
        try:
            await self.respond(scope, receive, timing.send)
        except GatewayError as exc:
            await send_json(timing.send, exc.status, exc.body, exc.headers)
        except psycopg.Error:
            logger.exception("the gateway could not read its catalog")
            if timing.status:
                raise
            await send_json(
                timing.send,
                503,
                unavailable(
                    "The gateway cannot read its configuration now; retry.",
                    retry=5,
                    code=GatewayErrorCode.CATALOG_UNAVAILABLE,
                ).body,
                [(b"retry-after", b"5")],
            )
        except Exception:
            logger.exception("the gateway failed on %s", scope["path"])
            if timing.status:
                raise  # the answer has started: the connection is cut, the client sees an error
            await send_json(
                timing.send,
                500,
                {
                    "error": {
                        "message": "Internal server error.",
                        "type": "server_error",
                        "param": None,
                        "code": GatewayErrorCode.SERVER_ERROR,
                    }
                },
            )
        finally:
            record_gateway_request(
                ENDPOINTS.get(scope["path"], "models"),
                timing.status,
                disconnected=timing.disconnected,
                seconds=time.perf_counter() - timing.started,
                first_byte=timing.first_byte,
            )

    async def respond(self, scope, receive, send) -> None:
        host = header(scope, b"host") or ""
        if not host_is_allowed(scope):
            raise bad_request(f"Invalid HTTP_HOST header: {host!r}.")
        if settings.SECURE_SSL_REDIRECT and not is_secure(scope):
            raise GatewayError(403, "Use HTTPS.", "invalid_request_error", GatewayErrorCode.HTTPS_REQUIRED)
        path, method = scope["path"], scope["method"]
        wanted = "GET" if path.startswith(MODELS_PATH) else "POST"
        if method != wanted:
            raise GatewayError(
                405,
                f"Method {method} not allowed on {path}.",
                "invalid_request_error",
                GatewayErrorCode.METHOD_NOT_ALLOWED,
                [(b"allow", wanted.encode())],
            )
        await self.catalog.fresh()
        if self._prober is None:
            self.start_background()
        key = await self.authenticate(scope)
        if wanted == "GET":
            await self.models(send, key, path)
            return
        body = await read_body(scope, receive, settings.HETEROFLOW_GATEWAY_MAX_BODY_BYTES)
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"The body is not valid JSON: {exc}.") from None
        if not isinstance(data, dict):
            raise bad_request("The body must be a JSON object.")
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise bad_request("you must provide a model parameter", param="model")
        service = await self.service_for(key, model)
        try:
            await self.proxy(scope, receive, send, key, service, path, body, data)
        except GatewayError as exc:
            # Nothing was sent yet. The cached routes may predate the service falling
            # asleep (its replicas stopped): read them again, and wake it rather than 502.
            if exc.code != GatewayErrorCode.BACKEND_UNREACHABLE:
                raise
            self.catalog.forget_routes(key.tenant_id)
            now = {s.id: s for s in (await self.catalog.routes(key.tenant_id)).get(model, [])}.get(service.id)
            if now is None or now.state not in ("sleeping", "waking"):
                raise
            await self.proxy(scope, receive, send, key, await self.wake(key, now), path, body, data)

    async def authenticate(self, scope) -> KeyInfo:
        scheme, _, token = (header(scope, b"authorization") or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise unauthorized(
                "You didn't provide an API key. Send an endpoint key (sk-hf-...) as Authorization: Bearer.",
                code=GatewayErrorCode.MISSING_API_KEY,
            )
        if token.startswith(TENANT_KEY_PREFIXES):
            raise unauthorized(
                "Tenant and platform keys (sk-tenant-, sk-admin-) manage the platform; the OpenAI-compatible "
                "endpoints take an endpoint key (sk-hf-...), created under /api/v1/gateway/keys."
            )
        if not keys.is_endpoint_key(token):
            raise unauthorized("Incorrect API key provided.")
        key = await self.catalog.key(keys.hash_key(token))
        if key is None:
            raise unauthorized("Incorrect API key provided.")
        refusal = key.refusal(datetime.now(UTC))
        if refusal:
            raise unauthorized(refusal)
        self.meter.key_used(key.id)
        return key

    async def models(self, send, key: KeyInfo, path: str) -> None:
        routes = await self.catalog.routes(key.tenant_id)
        names = sorted(name for name in routes if key.may_call(name))
        entries = {name: {"id": name, "object": "model", "created": 0, "owned_by": key.tenant_slug} for name in names}
        if path.rstrip("/") == MODELS_PATH:
            await send_json(send, 200, {"object": "list", "data": list(entries.values())})
            return
        wanted = path[len(MODELS_PATH) + 1 :]
        if wanted not in entries:
            raise GatewayError(
                404, f"The model '{wanted}' does not exist.", "invalid_request_error", GatewayErrorCode.MODEL_NOT_FOUND
            )
        await send_json(send, 200, entries[wanted])

    async def service_for(self, key: KeyInfo, model: str) -> Service:
        services = (await self.catalog.routes(key.tenant_id)).get(model)
        if not services:
            raise GatewayError(
                404,
                f"The model '{model}' does not exist or you do not have access to it.",
                "invalid_request_error",
                GatewayErrorCode.MODEL_NOT_FOUND,
                param="model",
            )
        if not key.may_call(model):
            raise GatewayError(
                403,
                f"This API key may not call the model '{model}'.",
                "permission_error",
                GatewayErrorCode.MODEL_NOT_ALLOWED,
                param="model",
            )
        if len(services) == 1:
            if self.catalog.usable(services[0].usable_backends()):
                return services[0]
        else:
            usable = [bool(self.catalog.usable(s.usable_backends())) for s in services]
            chosen = routing.pick_service(services, usable, random.random())
            if chosen is not None:
                return services[chosen]
        asleep = [s for s in services if s.state in ("sleeping", "waking")]
        if asleep:
            return await self.wake(key, asleep[0])
        raise unavailable(f"No healthy backend serves '{model}' right now; try again shortly.", retry=5)

    async def wake(self, key: KeyInfo, service: Service) -> Service:
        """A sleeping service: ask for its wake (at most every few seconds per process),
        then wait up to HETEROFLOW_GATEWAY_WAKE_WAIT_SECONDS for a healthy replica, or
        answer 503 with Retry-After."""
        now = time.monotonic()
        if now - self._woken.get(service.id, -1e9) >= WAKE_EVERY_SECONDS:
            self._woken[service.id] = now
            asyncio.get_running_loop().run_in_executor(None, ask_for_wake, service.id)
        self.meter.requested(service.id)
        deadline = now + settings.HETEROFLOW_GATEWAY_WAKE_WAIT_SECONDS
        while time.monotonic() < deadline:
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
            self.catalog.forget_routes(key.tenant_id)
            for candidate in (await self.catalog.routes(key.tenant_id)).get(service.model, []):
                if candidate.id == service.id and self.catalog.usable(candidate.usable_backends()):
                    return candidate
        raise unavailable(
            f"The model '{service.model}' is waking up; retry in a few seconds.",
            retry=settings.HETEROFLOW_GATEWAY_WAKE_RETRY_AFTER_SECONDS,
            code=GatewayErrorCode.MODEL_WAKING,
        )

    def choose(self, scope, data: dict, service: Service) -> tuple[list[str], str | None]:
        """(candidates for the admission script, the level of stickiness that chose)."""
        usable = [b.address for b in self.catalog.usable(service.usable_backends())]
        if self.stickiness:
            found = routing.session_key(header(scope, b"x-session-id"), data)
            if found is not None:
                level, session = found
                chosen = routing.sticky_choice(session, [b.address for b in service.backends], usable)
                if chosen is not None:
                    return [chosen], level
        if len(usable) == 1 or self.balancer == Balancer.ROUND_ROBIN:
            return [routing.round_robin(next(self._turns), usable)], None
        if self.balancer == Balancer.RANDOM:
            return [routing.random_choice(usable)], None
        return usable, None  # least_connections: the admission script picks

    async def proxy(self, scope, receive, send, key: KeyInfo, service: Service, path, body: bytes, data) -> None:
        limits = await self.limits()
        candidates, _level = self.choose(scope, data, service)
        request_id = uuid.uuid4().hex
        now = time.time()
        shared = not self.catalog.redis_away
        if shared:
            try:
                async with asyncio.timeout(REDIS_TIMEOUT):
                    admission = await limits.admit(key, service.id, request_id, candidates, now, next(self._turns))
            except (RedisError, OSError, TimeoutError):
                self.redis_lost()
                shared = False
            else:
                if admission.admitted:
                    self.local.started(key, now)
        if not shared:
            admission = self.admit_without_redis(key, now)
        if not admission.admitted:
            self.meter.refused(key, data.get("model"), service.id)
            whose = "this API key" if admission.whose == "key" else "this tenant"
            what = {
                "requests": "requests per minute",
                "tokens": "tokens per minute",
                "concurrency": "concurrent requests",
            }
            raise GatewayError(
                429,
                f"Rate limit reached for {whose}: {what[admission.kind]}. Retry after the window resets.",
                "tokens" if admission.kind == "tokens" else "requests",
                GatewayErrorCode.RATE_LIMIT_EXCEEDED,
                [(b"retry-after", str(retry_after(admission.kind, now)).encode())],
            )
        backend = candidates[admission.picked if admission.picked is not None else 0]
        self.meter.requested(service.id)
        outcome = Outcome()
        outcome.shared = shared
        task = asyncio.current_task()

        async def watch():
            # the body was read: the next message is the client leaving (or the answer's end)
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not outcome.finishing:
                        outcome.disconnected = True
                        task.cancel()
                    return

        watcher = asyncio.create_task(watch())
        try:
            await self.forward(send, service, backend, path, body, data, request_id, outcome, limits, scope)
        except asyncio.CancelledError:
            if not outcome.disconnected:
                raise
            task.uncancel()
            outcome.error = True  # the client left: the upstream request was closed with it
            timing = getattr(send, "__self__", None)
            if isinstance(timing, Timing):
                timing.disconnected = True
        finally:
            watcher.cancel()
            # every exit: done, refused upstream, failed, cancelled by a client that left
            await asyncio.shield(self.finish(limits, key, service, request_id, outcome, data))

    async def finish(self, limits: Limits, key, service, request_id, outcome, data) -> None:
        total_tokens = outcome.prompt_tokens + outcome.completion_tokens
        self.local.ended(key, time.time(), total_tokens)
        if outcome.shared:  # admitted through Redis: its counts there go back
            try:
                async with asyncio.timeout(REDIS_TIMEOUT):
                    await limits.release(
                        key,
                        service.id,
                        request_id,
                        outcome.backend,
                        time.time(),
                        total_tokens=total_tokens,
                        completion_tokens=outcome.completion_tokens,
                    )
            except Exception:
                logger.warning("could not release the counts of request %s", request_id, exc_info=True)
        self.meter.done(key, data.get("model"), service.id, outcome)
        record_gateway_tokens(outcome.prompt_tokens, outcome.completion_tokens)

    async def forward(self, send, service, backend, path, body, data, request_id, outcome, limits, scope):
        client = self.client()
        headers = {
            name.decode(): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in FORWARDED_REQUEST_HEADERS
        }
        headers["Accept-Encoding"] = "identity"
        if service.auth:
            headers["Authorization"] = f"Bearer {service.auth}"  # an external backend's token
        streaming = data.get("stream") is True
        response = None
        outcome.backend = backend
        for attempt in (1, 2):
            try:
                response = await client.post(backend + path, data=body, headers=headers, allow_redirects=False)
                break
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                self.catalog.quarantine(backend)
                others = [b.address for b in self.catalog.usable(service.usable_backends()) if b.address != backend]
                if attempt == 2 or not others:
                    outcome.error = True
                    raise GatewayError(
                        502,
                        f"The model's backend could not be reached ({type(exc).__name__}).",
                        "server_error",
                        GatewayErrorCode.BACKEND_UNREACHABLE,
                    ) from None
                picked = None
                if outcome.shared:
                    try:
                        async with asyncio.timeout(REDIS_TIMEOUT):
                            picked = await limits.repick(request_id, backend, others, time.time())
                    except (RedisError, OSError, TimeoutError):
                        self.redis_lost()
                backend = others[picked or 0]
                outcome.backend = backend
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise backend_failed(exc, outcome, "") from None
        finished = False
        try:
            outcome.status = response.status
            if response.status >= 400:
                outcome.error = True
            sse = response.headers.get("content-type", "").startswith("text/event-stream")
            if streaming and sse:
                await self.stream(send, response, outcome)
            else:
                await self.whole(send, response, outcome)
            finished = True
        finally:
            if finished:
                response.release()  # the connection goes back to the pool
            else:
                response.close()  # cut: the backend sees its client leave and stops

    async def whole(self, send, response: aiohttp.ClientResponse, outcome) -> None:
        try:
            payload = await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise backend_failed(exc, outcome, " mid-answer") from None
        outcome.prompt_tokens, outcome.completion_tokens = usage_of_body(payload)
        outcome.finishing = True
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [*passed_headers(response), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def stream(self, send, response: aiohttp.ClientResponse, outcome) -> None:
        """Chunk by chunk. A client that leaves cancels this (and so the upstream read);
        a backend that fails mid-stream ends the stream with an error event, which the
        OpenAI client raises."""
        tail = bytearray()
        chunks = 0
        await send({"type": "http.response.start", "status": response.status, "headers": passed_headers(response)})
        idle = settings.HETEROFLOW_GATEWAY_IDLE_TIMEOUT_SECONDS
        content = response.content
        while True:
            try:
                async with asyncio.timeout(idle if chunks else None):
                    chunk = await content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome.error = True
                event = {
                    "error": {
                        "message": f"The model's backend failed mid-stream ({type(exc).__name__}).",
                        "type": "server_error",
                        "param": None,
                        "code": GatewayErrorCode.BACKEND_ERROR,
                    }
                }
                await send(
                    {"type": "http.response.body", "body": b"data: " + orjson.dumps(event) + b"\n\n", "more_body": True}
                )
                break
            if not chunk:
                break
            chunks += 1
            tail += chunk
            if len(tail) > 65_536:
                del tail[:-65_536]
            outcome.chunks += chunk.count(b"data: ")
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        outcome.prompt_tokens, outcome.completion_tokens = usage_of_stream(bytes(tail), outcome.chunks)
        outcome.finishing = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Timing:
    """Wraps `send`: the answer's status and when its first byte went out, for the metrics."""

    __slots__ = ("_send", "started", "status", "first_byte", "disconnected")

    def __init__(self, send):
        self._send = send
        self.started = time.perf_counter()
        self.status = 0
        self.first_byte: float | None = None
        self.disconnected = False

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif self.first_byte is None and message.get("body"):
            self.first_byte = time.perf_counter() - self.started
        await self._send(message)


class Outcome:
    """What a request came to, for the release and the meter."""

    __slots__ = (
        "backend",
        "shared",
        "status",
        "error",
        "disconnected",
        "finishing",
        "prompt_tokens",
        "completion_tokens",
        "chunks",
    )

    def __init__(self):
        self.backend: str | None = None
        self.shared = True  # admitted through Redis (else by this process alone)
        self.status = 0
        self.error = False
        self.disconnected = False
        self.finishing = False  # the answer's last message is being sent: a disconnect now changes nothing
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.chunks = 0


def in_thread(write, *args) -> None:
    """A write through the ORM, off the loop (on the executor's thread), whose connection
    is closed after it: these are rare, and a thread's idle connection would outlive a
    database restart."""
    try:
        write(*args)
    except Exception:
        logger.warning("%s failed", write.__name__, exc_info=True)
    finally:
        connection.close()


def ask_for_wake(service_id: int) -> None:
    try:
        enqueue("inference.wake_service", service_id)
    except Exception:
        logger.warning("could not ask for the wake of service %s", service_id, exc_info=True)


def passed_headers(response: aiohttp.ClientResponse) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in response.raw_headers if name.lower() not in DROPPED_RESPONSE_HEADERS]


async def send_json(send, status: int, body, headers=()) -> None:
    payload = orjson.dumps(body)
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


async def read_body(scope, receive, limit: int) -> bytes:
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(
            413, f"The body may be at most {limit} bytes.", "invalid_request_error", GatewayErrorCode.PAYLOAD_TOO_LARGE
        )
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise bad_request("The client went away.")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(
                413,
                f"The body may be at most {limit} bytes.",
                "invalid_request_error",
                GatewayErrorCode.PAYLOAD_TOO_LARGE,
            )
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)
