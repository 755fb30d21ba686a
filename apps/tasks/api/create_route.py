"""POST /api/v1/tasks with an API key, served as a thin ASGI route in front of Django.

A sweep submits thousands of tasks one by one, and Django's middleware stack and DRF's
view machinery were most of a create's time. This route answers a create that carries
`Authorization: Bearer` and a JSON object body with the same code the DRF view runs
(apps.tasks.api.create: the serializer, submission.submit_task, the task's body; the
Bearer key checked by apps.core.authentication.authenticate_bearer; the view's
permission class), in a small pool of threads that keep their database connections,
and puts the headers on the answer that Django's middleware would. Anything it does not
handle exactly as Django would goes to Django unchanged: no Bearer header (sessions,
the agent key, none), another content type or Accept, no or an oversized
Content-Length, a body that is not a JSON object (DRF says why in its words), a Host
not allowed, plain HTTP when HTTPS is required. The API's rate limit applies here as in
DRF (apps.core.throttling.check_principal: 429 with Retry-After).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import orjson
from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import connection
from django.http import Http404
from rest_framework import exceptions

from apps.core.asgi import ClientGone, ThinRoute, header, host_is_allowed, is_secure, read_body, send_json
from apps.core.authentication import BEARER_CHALLENGE, authenticate_bearer
from apps.core.error_codes import CoreErrorCode
from apps.core.errors import error_body, exception_handler
from apps.core.throttling import check_principal
from apps.monitoring.metrics import record_task_create
from apps.tasks.api.create import create_task_answer
from apps.tasks.api.views import PeopleOrAgent, TaskListView

logger = logging.getLogger(__name__)

PATH = "/api/v1/tasks"
# Creates of one tenant queue on its usage row anyway; a few threads let creates of
# different tenants overlap and keep the event loop free. Each keeps one database
# connection between creates, taken from Django's pool as a request takes one: at most
# half the pool, so that the rest of Django always has connections.
CREATE_THREADS = 4


def create_threads() -> int:
    pool = settings.DATABASES["default"].get("OPTIONS", {}).get("pool")
    if not pool:
        return CREATE_THREADS  # no pool: each thread's connection is its own
    return max(1, min(CREATE_THREADS, pool.get("max_size", 2 * CREATE_THREADS) // 2))


def _json_media_type(value: str | None) -> bool:
    """application/json, with at most a utf-8 charset: what DRF's JSONParser reads as
    this route does."""
    if value is None:
        return False
    media, *params = (part.strip().lower() for part in value.split(";"))
    return media == "application/json" and all(param in ("", "charset=utf-8") for param in params)


def _accepts_json(value: str | None) -> bool:
    return value is None or value.strip() in ("", "*/*", "application/json")


def _response_headers(scope) -> list[tuple[bytes, bytes]]:
    """The headers Django's middleware and DRF put on this view's answers."""
    headers = [(b"allow", b"GET, POST, HEAD, OPTIONS")]
    if settings.X_FRAME_OPTIONS:
        headers.append((b"x-frame-options", settings.X_FRAME_OPTIONS.encode()))
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers.append((b"x-content-type-options", b"nosniff"))
    if settings.SECURE_REFERRER_POLICY:
        policy = settings.SECURE_REFERRER_POLICY
        policy = policy if isinstance(policy, str) else ",".join(policy)
        headers.append((b"referrer-policy", policy.encode()))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers.append((b"cross-origin-opener-policy", settings.SECURE_CROSS_ORIGIN_OPENER_POLICY.encode()))
    if settings.SECURE_HSTS_SECONDS and is_secure(scope):
        sts = f"max-age={settings.SECURE_HSTS_SECONDS}"
        if settings.SECURE_HSTS_INCLUDE_SUBDOMAINS:
            sts += "; includeSubDomains"
        if settings.SECURE_HSTS_PRELOAD:
            sts += "; preload"
        headers.append((b"strict-transport-security", sts.encode()))
    return headers


def answer_bearer_create(token: str, data) -> tuple[int, dict, list[tuple[bytes, bytes]]]:
    """The DRF view's answer to a POST with this Bearer token and parsed body: status,
    body and extra headers. Runs in a create thread (it uses the ORM)."""
    try:
        try:
            _, principal = authenticate_bearer(token)
            if not PeopleOrAgent().has_permission(SimpleNamespace(auth=principal, method="POST"), TaskListView):
                raise exceptions.PermissionDenied(PeopleOrAgent.message)
            check_principal(principal)  # the API's rate limit, after the permission as in DRF
            return 201, create_task_answer(principal, data), []
        except (exceptions.APIException, Http404, DjangoPermissionDenied) as exc:
            extra = []
            if isinstance(exc, (exceptions.NotAuthenticated, exceptions.AuthenticationFailed)):
                extra = [(b"www-authenticate", BEARER_CHALLENGE.encode())]
            response = exception_handler(exc, {})
            if response.has_header("Retry-After"):
                extra.append((b"retry-after", response["Retry-After"].encode()))
            return response.status_code, response.data, extra
    finally:
        _keep_or_close(connection)


def _keep_or_close(conn) -> None:
    """Django's close_if_unusable_or_obsolete for a connection kept across creates: it
    is given back when it was left in a transaction or broken by an error."""
    if conn.connection is None:
        return
    if conn.in_atomic_block or conn.get_autocommit() != conn.settings_dict["AUTOCOMMIT"]:
        conn.close()
    elif conn.errors_occurred:
        if conn.is_usable():
            conn.errors_occurred = False
        else:
            conn.close()


class TaskCreateApp(ThinRoute):
    """POST /api/v1/tasks with `Authorization: Bearer` and a JSON body, answered without
    Django's middleware and view stack; everything else goes to `fallback`."""

    def __init__(self, fallback):
        super().__init__(fallback)
        self._executor: ThreadPoolExecutor | None = None

    def handles(self, scope) -> bool:
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
            return False
        scheme, _, _ = (header(scope, b"authorization") or "").partition(" ")
        length = header(scope, b"content-length")
        return (
            scheme.lower() == "bearer"
            and _json_media_type(header(scope, b"content-type"))
            and _accepts_json(header(scope, b"accept"))
            and length is not None
            and length.isdigit()
            and 0 < int(length) <= settings.DATA_UPLOAD_MAX_MEMORY_SIZE
            and host_is_allowed(scope)
            and not (settings.SECURE_SSL_REDIRECT and not is_secure(scope))
        )

    def match(self, scope) -> bool | None:
        return True if self.handles(scope) else None

    async def handle(self, scope, receive, send, matched) -> None:
        body, receive = await _read_body(scope, receive)
        data = _json_object(body)
        if data is None:
            # not a JSON object: DRF's parser or the serializer says why in its own
            # words, from the body handed on as it came
            await self.fallback(scope, receive, send)
            return
        token = (header(scope, b"authorization") or "").partition(" ")[2]
        try:
            status, answer, extra = await asyncio.get_running_loop().run_in_executor(
                self.executor(), answer_bearer_create, token, data
            )
        except Exception:
            logger.exception("task create failed")
            status, answer, extra = 500, error_body(CoreErrorCode.SERVER_ERROR, "Internal server error."), []
        record_task_create(status)
        headers = [*extra, *_response_headers(scope)]
        await send_json(send, status, answer, headers, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_UTC_Z)

    def executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(create_threads(), thread_name_prefix="task-create")
        return self._executor

    def shutdown(self) -> None:
        """Give back every create thread's connection and stop the threads."""
        if self._executor is None:
            return
        started = len(self._executor._threads)
        together = threading.Barrier(started)

        def close_mine():
            together.wait(10)  # one call per thread: each waits until all have one
            connection.close()

        for future in [self._executor.submit(close_mine) for _ in range(started)]:
            future.result()
        self._executor.shutdown()
        self._executor = None


def _json_object(body: bytes | None) -> dict | None:
    if body is None:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


async def _read_body(scope, receive):
    """The whole body (None if the client went away) and a `receive` that hands it on
    again, for the fallback. No limit here: `handles` took only a Content-Length within
    Django's."""
    try:
        body = await read_body(scope, receive)
    except ClientGone:
        return None, receive
    replayed = False

    async def again():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, again
