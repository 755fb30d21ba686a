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

from apps.core.asgi import BodyTooLarge, ClientGone, ThinRoute, header, host_is_allowed, is_secure, read_body, send_json
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
from apps.gateway.prober import Prober
from apps.gateway.usage import Meter, ShareClock, ShareClocks, usage_of_body, usage_of_stream
from apps.monitoring.metrics import record_gateway_request, record_gateway_tokens, record_gateway_without_redis

logger = logging.getLogger(__name__)

POST_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
MODELS_PATH = "/v1/models"
# a sleeping service's wake is asked for at most this often by one process, however many
# requests wait for it: each ask is a job sent through the broker
WAKE_EVERY_SECONDS = 5.0
# routes read again, at most this often per tenant, when the cached ones leave no usable backend
REREAD_EVERY_SECONDS = 1.0
REDIS_AWAY_RETRY_SECONDS = 1.0  # how often a process asks whether Redis is back
TENANT_KEY_PREFIXES = ("sk-tenant-", "sk-admin-")
FORWARDED_REQUEST_HEADERS = (b"content-type", b"accept")
DROPPED_RESPONSE_HEADERS = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"server", b"date"}
)


class GatewayError(Exception):
    """An answer in OpenAI's error shape, and the one place that shape is made: the
    constructors below name the errors the gateway answers with."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None, headers=(), param=None):
        super().__init__(message)
        self.status, self.headers, self.code = status, list(headers), code
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}

    @classmethod
    def unauthorized(cls, message: str, code: str = GatewayErrorCode.INVALID_API_KEY) -> GatewayError:
        return cls(401, message, "authentication_error", code, [(b"www-authenticate", b'Bearer realm="heteroflow"')])

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> GatewayError:
        return cls(400, message, "invalid_request_error", code, param=param)

    @classmethod
    def too_large(cls, limit: int) -> GatewayError:
        return cls(
            413, f"The body may be at most {limit} bytes.", "invalid_request_error", GatewayErrorCode.PAYLOAD_TOO_LARGE
        )

    @classmethod
    def rate_limited(cls, admission: Admission, now: float) -> GatewayError:
        whose = "this API key" if admission.whose == "key" else "this tenant"
        what = {"requests": "requests per minute", "tokens": "tokens per minute", "concurrency": "concurrent requests"}
        return cls(
            429,
            f"Rate limit reached for {whose}: {what[admission.kind]}. Retry after the window resets.",
            "tokens" if admission.kind == "tokens" else "requests",
            GatewayErrorCode.RATE_LIMIT_EXCEEDED,
            [(b"retry-after", str(retry_after(admission.kind, now)).encode())],
        )

    @classmethod
    def server_error(cls) -> GatewayError:
        return cls(500, "Internal server error.", "server_error", GatewayErrorCode.SERVER_ERROR)

    @classmethod
    def unreachable(cls, exc: BaseException) -> GatewayError:
        return cls(
            502,
            f"The model's backend could not be reached ({type(exc).__name__}).",
            "server_error",
            GatewayErrorCode.BACKEND_UNREACHABLE,
        )

    @classmethod
    def backend_error(cls, exc: BaseException, when: str) -> GatewayError:
        """The backend failed, `when` it did ("", " mid-answer", " mid-stream")."""
        return cls(
            502,
            f"The model's backend failed{when} ({type(exc).__name__}).",
            "server_error",
            GatewayErrorCode.BACKEND_ERROR,
        )

    @classmethod
    def backend_failed(cls, exc: BaseException, when: str) -> GatewayError:
        """A backend that timed out (504) or failed (502)."""
        if isinstance(exc, TimeoutError):
            return cls(
                504, "The model's backend did not answer in time.", "server_error", GatewayErrorCode.BACKEND_TIMEOUT
            )
        return cls.backend_error(exc, when)

    @classmethod
    def unavailable(
        cls, message: str, retry: int | None = None, code: str = GatewayErrorCode.NO_HEALTHY_BACKEND
    ) -> GatewayError:
        headers = [(b"retry-after", str(retry).encode())] if retry else []
        return cls(503, message, "service_unavailable", code, headers)


class Call:
    """One request's state, from its scope to the release of its counts: what the
    gateway's methods hand one another. The last three are the proxying's, set afresh
    for each attempt (a request retried on a service just woken is proxied twice)."""

    __slots__ = (
        "scope",
        "receive",
        "timing",
        "send",
        "path",
        "key",
        "body",
        "data",
        "service",
        "limits",
        "request_id",
        "outcome",
        "turn",
    )

    def __init__(self, scope, receive, timing: Timing):
        self.scope, self.receive, self.timing, self.send = scope, receive, timing, timing.send
        self.path: str = scope["path"]
        self.key: KeyInfo | None = None
        self.body = b""
        self.data: dict = {}
        self.service: Service | None = None
        self.limits: Limits | None = None
        self.request_id = ""
        self.outcome: Outcome | None = None
        self.turn = 0  # this attempt's place in the process's rotation


class GatewayApp(ThinRoute):
    """/v1/* answered here; everything else goes to `fallback` (Django)."""

    def __init__(self, fallback, *, catalog: Catalog | None = None):
        super().__init__(fallback)
        self.catalog = catalog or Catalog()
        self.meter = Meter(self.catalog)
        self.clocks = ShareClocks()  # each replica's GPU-seconds shared among its requests in flight
        self.prober = Prober(self.catalog, self.client)
        self._client: aiohttp.ClientSession | None = None
        self._client_loop = None
        self._limits: Limits | None = None
        self._limits_redis = None
        self._turns = count()
        self._woken: dict[int, float] = {}
        self._reread: dict[int, float] = {}  # tenant -> when its routes were last read again (no backend)
        self._probing: asyncio.Task | None = None
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

    def match(self, scope) -> bool | None:
        path = scope["path"]
        if path in POST_PATHS or path == MODELS_PATH or path.startswith(MODELS_PATH + "/"):
            return True
        return None

    async def lifespan(self, scope, receive, send) -> None:
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

    # --- background ----------------------------------------------------------------------

    def start_background(self) -> None:
        """The probe of the replicas (apps.gateway.prober), the count of the gateway
        processes (and the watch on Redis) and the usage flush, each a task on this loop."""
        loop = asyncio.get_running_loop()

        def started(task, body):
            if task is None or task.done() or task.get_loop() is not loop:
                return loop.create_task(body())
            return task

        self._probing = started(self._probing, self.prober.forever)
        self._keeper = started(self._keeper, self.keep_forever)
        self._flusher = started(self._flusher, self.flush_forever)

    async def probe_once(self) -> dict[str, bool]:
        return await self.prober.once()

    async def flush_forever(self) -> None:
        """Usage is written at least every HETEROFLOW_GATEWAY_FLUSH_SECONDS, requests or
        not: a process killed loses at most that long's worth."""
        while True:
            await asyncio.sleep(settings.HETEROFLOW_GATEWAY_FLUSH_SECONDS)
            if self.meter.pending():
                await self.meter.flush()

    async def close(self) -> None:
        for task in (self._probing, self._keeper, self._flusher):
            if task is not None:
                task.cancel()
        self._probing = self._keeper = self._flusher = None
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
            self.clocks.clean()
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
            raise GatewayError.unavailable(
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

    # --- the request -------------------------------------------------------------------

    async def handle(self, scope, receive, send, matched) -> None:
        timing = Timing(send)
        call = Call(scope, receive, timing)
        try:
            await self.respond(call)
        except GatewayError as exc:
            await send_json(call.send, exc.status, exc.body, exc.headers)
        except psycopg.Error:
            logger.exception("the gateway could not read its catalog")
            if timing.status:
                raise
            exc = GatewayError.unavailable(
                "The gateway cannot read its configuration now; retry.",
                retry=5,
                code=GatewayErrorCode.CATALOG_UNAVAILABLE,
            )
            await send_json(call.send, exc.status, exc.body, exc.headers)
        except Exception:
            logger.exception("the gateway failed on %s", call.path)
            if timing.status:
                raise  # the answer has started: the connection is cut, the client sees an error
            exc = GatewayError.server_error()
            await send_json(call.send, exc.status, exc.body, exc.headers)
        finally:
            record_gateway_request(
                ENDPOINTS.get(call.path, "models"),
                timing.status,
                disconnected=timing.disconnected,
                seconds=time.perf_counter() - timing.started,
                first_byte=timing.first_byte,
            )

    async def respond(self, call: Call) -> None:
        scope = call.scope
        host = header(scope, b"host") or ""
        if not host_is_allowed(scope):
            raise GatewayError.bad_request(f"Invalid HTTP_HOST header: {host!r}.")
        if settings.SECURE_SSL_REDIRECT and not is_secure(scope):
            raise GatewayError(403, "Use HTTPS.", "invalid_request_error", GatewayErrorCode.HTTPS_REQUIRED)
        path, method = call.path, scope["method"]
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
        if self._probing is None:
            self.start_background()
        call.key = await self.authenticate(scope)
        if wanted == "GET":
            await self.models(call)
            return
        try:
            call.body = await read_body(scope, call.receive, settings.HETEROFLOW_GATEWAY_MAX_BODY_BYTES)
        except BodyTooLarge as exc:
            raise GatewayError.too_large(exc.limit) from None
        except ClientGone:
            raise GatewayError.bad_request("The client went away.") from None
        try:
            call.data = orjson.loads(call.body)
        except orjson.JSONDecodeError as exc:
            raise GatewayError.bad_request(f"The body is not valid JSON: {exc}.") from None
        if not isinstance(call.data, dict):
            raise GatewayError.bad_request("The body must be a JSON object.")
        model = call.data.get("model")
        if not isinstance(model, str) or not model:
            raise GatewayError.bad_request("you must provide a model parameter", param="model")
        call.service = await self.service_for(call.key, model)
        try:
            await self.proxy(call)
        except GatewayError as exc:
            # Nothing was sent yet. The cached routes may predate the service falling
            # asleep (its replicas stopped): read them again, and wake it rather than 502.
            if exc.code != GatewayErrorCode.BACKEND_UNREACHABLE:
                raise
            tenant_id = call.key.tenant_id
            self.catalog.forget_routes(tenant_id)
            now = {s.id: s for s in (await self.catalog.routes(tenant_id)).get(model, [])}.get(call.service.id)
            if now is None or now.state not in ("sleeping", "waking"):
                raise
            call.service = await self.wake(call.key, now)
            await self.proxy(call)

    async def authenticate(self, scope) -> KeyInfo:
        scheme, _, token = (header(scope, b"authorization") or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise GatewayError.unauthorized(
                "You didn't provide an API key. Send an endpoint key (sk-hf-...) as Authorization: Bearer.",
                code=GatewayErrorCode.MISSING_API_KEY,
            )
        if token.startswith(TENANT_KEY_PREFIXES):
            raise GatewayError.unauthorized(
                "Tenant and platform keys (sk-tenant-, sk-admin-) manage the platform; the OpenAI-compatible "
                "endpoints take an endpoint key (sk-hf-...), created under /api/v1/gateway/keys."
            )
        if not keys.is_endpoint_key(token):
            raise GatewayError.unauthorized("Incorrect API key provided.")
        key = await self.catalog.key(keys.hash_key(token))
        if key is None:
            raise GatewayError.unauthorized("Incorrect API key provided.")
        refusal = key.refusal(datetime.now(UTC))
        if refusal:
            raise GatewayError.unauthorized(refusal)
        self.meter.key_used(key.id)
        return key

    async def models(self, call: Call) -> None:
        key, path = call.key, call.path
        routes = await self.catalog.routes(key.tenant_id)
        names = sorted(name for name in routes if key.may_call(name))
        entries = {name: {"id": name, "object": "model", "created": 0, "owned_by": key.tenant_slug} for name in names}
        if path.rstrip("/") == MODELS_PATH:
            await send_json(call.send, 200, {"object": "list", "data": list(entries.values())})
            return
        wanted = path[len(MODELS_PATH) + 1 :]
        if wanted not in entries:
            raise GatewayError(
                404, f"The model '{wanted}' does not exist.", "invalid_request_error", GatewayErrorCode.MODEL_NOT_FOUND
            )
        await send_json(call.send, 200, entries[wanted])

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
        now = time.monotonic()
        if not asleep and now - self._reread.get(key.tenant_id, -1e9) >= REREAD_EVERY_SECONDS:
            # No usable backend: the cached routes may predate the service falling asleep,
            # its stopped replicas already out of rotation (the prober's quarantine). Read
            # them again (at most every REREAD_EVERY_SECONDS: an outage is not a read per
            # request) before answering that nothing serves the model.
            self._reread[key.tenant_id] = now
            self.catalog.forget_routes(key.tenant_id)
            fresh = (await self.catalog.routes(key.tenant_id)).get(model) or []
            asleep = [s for s in fresh if s.state in ("sleeping", "waking")]
        if asleep:
            return await self.wake(key, asleep[0])
        raise GatewayError.unavailable(f"No healthy backend serves '{model}' right now; try again shortly.", retry=5)

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
        raise GatewayError.unavailable(
            f"The model '{service.model}' is waking up; retry in a few seconds.",
            retry=settings.HETEROFLOW_GATEWAY_WAKE_RETRY_AFTER_SECONDS,
            code=GatewayErrorCode.MODEL_WAKING,
        )

    def choose(self, call: Call) -> tuple[list[str], str | None]:
        """(candidates for the admission script, the level of stickiness that chose)."""
        service = call.service
        usable = [b.address for b in self.catalog.usable(service.usable_backends())]
        if self.stickiness:
            found = routing.session_key(header(call.scope, b"x-session-id"), call.data)
            if found is not None:
                level, session = found
                chosen = routing.sticky_choice(session, [b.address for b in service.backends], usable)
                if chosen is not None:
                    return [chosen], level
        if len(usable) == 1 or self.balancer == Balancer.ROUND_ROBIN:
            return [routing.round_robin(call.turn, usable)], None
        if self.balancer == Balancer.RANDOM:
            return [routing.random_choice(usable)], None
        return usable, None  # least_connections: the admission script picks

    async def proxy(self, call: Call) -> None:
        key, service = call.key, call.service
        limits = call.limits = await self.limits()
        # one turn an attempt, for the round robin and the admission's tie-break alike (two
        # turns an attempt would send every request of a process to the same of two replicas)
        call.turn = next(self._turns)
        candidates, _level = self.choose(call)
        request_id = call.request_id = uuid.uuid4().hex
        now = time.time()
        shared = not self.catalog.redis_away
        if shared:
            try:
                async with asyncio.timeout(REDIS_TIMEOUT):
                    admission = await limits.admit(key, service.id, request_id, candidates, now, call.turn)
            except (RedisError, OSError, TimeoutError):
                self.redis_lost()
                shared = False
            else:
                if admission.admitted:
                    self.local.started(key, now)
        if not shared:
            admission = self.admit_without_redis(key, now)
        if not admission.admitted:
            self.meter.refused(key, call.data.get("model"), service.id)
            raise GatewayError.rate_limited(admission, now)
        backend = candidates[admission.picked if admission.picked is not None else 0]
        self.meter.requested(service.id)
        outcome = call.outcome = Outcome()
        outcome.shared = shared
        task = asyncio.current_task()
        receive = call.receive

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
            await self.forward(call, backend)
        except asyncio.CancelledError:
            if not outcome.disconnected:
                raise
            task.uncancel()
            outcome.error = True  # the client left: the upstream request was closed with it
            call.timing.disconnected = True
        finally:
            watcher.cancel()
            # every exit: done, refused upstream, failed, cancelled by a client that left
            await asyncio.shield(self.finish(call))

    async def finish(self, call: Call) -> None:
        key, service, request_id, outcome = call.key, call.service, call.request_id, call.outcome
        self.let_go(outcome, counted=True)
        total_tokens = outcome.prompt_tokens + outcome.completion_tokens
        self.local.ended(key, time.time(), total_tokens)
        if outcome.shared:  # admitted through Redis: its counts there go back
            try:
                async with asyncio.timeout(REDIS_TIMEOUT):
                    await call.limits.release(
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
        self.meter.done(key, call.data.get("model"), service.id, outcome)
        record_gateway_tokens(outcome.prompt_tokens, outcome.completion_tokens)

    async def forward(self, call: Call, backend: str) -> None:
        service, outcome = call.service, call.outcome
        client = self.client()
        headers = {
            name.decode(): value.decode("latin-1")
            for name, value in call.scope["headers"]
            if name in FORWARDED_REQUEST_HEADERS
        }
        headers["Accept-Encoding"] = "identity"
        if service.auth:
            headers["Authorization"] = f"Bearer {service.auth}"  # an external backend's token
        streaming = call.data.get("stream") is True
        response = None
        outcome.backend = backend
        for attempt in (1, 2):
            self.hold(outcome, backend, service.cards_of(backend))
            try:
                response = await client.post(
                    backend + call.path, data=call.body, headers=headers, allow_redirects=False
                )
                break
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                self.let_go(outcome, counted=False)  # it never reached the replica
                self.catalog.quarantine(backend)
                others = [b.address for b in self.catalog.usable(service.usable_backends()) if b.address != backend]
                if attempt == 2 or not others:
                    outcome.error = True
                    raise GatewayError.unreachable(exc) from None
                picked = None
                if outcome.shared:
                    try:
                        async with asyncio.timeout(REDIS_TIMEOUT):
                            picked = await call.limits.repick(call.request_id, backend, others, time.time())
                    except (RedisError, OSError, TimeoutError):
                        self.redis_lost()
                backend = others[picked or 0]
                outcome.backend = backend
            except (TimeoutError, aiohttp.ClientError) as exc:
                outcome.error = True
                raise GatewayError.backend_failed(exc, "") from None
        finished = False
        try:
            outcome.status = response.status
            if response.status >= 400:
                outcome.error = True
            sse = response.headers.get("content-type", "").startswith("text/event-stream")
            if streaming and sse:
                await self.stream(call, response)
            else:
                await self.whole(call, response)
            finished = True
        finally:
            if finished:
                response.release()  # the connection goes back to the pool
            else:
                response.close()  # cut: the backend sees its client leave and stops

    def hold(self, outcome: Outcome, backend: str, cards: float) -> None:
        """The request is sent to `backend`: it shares the replica's cards from now on."""
        if cards:
            outcome.clock = self.clocks.of(backend)
            outcome.gpu_start = outcome.clock.start(time.monotonic(), cards)

    def let_go(self, outcome: Outcome, *, counted: bool) -> None:
        """The request no longer holds its replica (it ended, however it ended; or its
        connection was refused: `counted` False, it held nothing)."""
        clock = outcome.clock
        if clock is not None:
            outcome.clock = None
            spent = clock.end(time.monotonic(), outcome.gpu_start)
            if counted:
                outcome.gpu_seconds += spent

    async def whole(self, call: Call, response: aiohttp.ClientResponse) -> None:
        outcome = call.outcome
        try:
            payload = await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            outcome.error = True
            raise GatewayError.backend_failed(exc, " mid-answer") from None
        outcome.prompt_tokens, outcome.completion_tokens = usage_of_body(payload)
        outcome.finishing = True
        send = call.send
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [*passed_headers(response), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    async def stream(self, call: Call, response: aiohttp.ClientResponse) -> None:
        """Chunk by chunk. A client that leaves cancels this (and so the upstream read);
        a backend that fails mid-stream ends the stream with an error event, which the
        OpenAI client raises."""
        send, outcome = call.send, call.outcome
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
                event = GatewayError.backend_error(exc, " mid-stream").body
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
        "clock",
        "gpu_start",
        "gpu_seconds",
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
        self.clock: ShareClock | None = None  # the replica's share clock while the request holds it
        self.gpu_start = 0.0  # its reading when the request was sent
        self.gpu_seconds = 0.0


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
