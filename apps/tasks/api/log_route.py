"""POST /api/v1/nodes/{id}/logs: the agent's live log batches, served as a thin ASGI route
in front of Django, like the heartbeat (the agent key, a bounded body, off the ORM, a
connection pool of its own so that logs never take the beats' connections).

The body is JSON, gzip-compressed when `Content-Encoding: gzip` says so:

    {"tasks": [{"task_id": 7, "run": "…", "dropped_bytes": 0,
                "lines": [[n, at, "stdout" | "stderr" | "system", "text"], …]}, …]}

`n` numbers the run's lines from 0, `at` is when the agent read the line (seconds since
the epoch). The answer says, per task, the run's next line the store expects (the agent
forgets what is below it) and which tasks it refused (not this node's: the agent stops
sending them): {"tasks": {"7": 120}, "refused": [9]}. Lines the store has are skipped,
so a batch sent twice stores its lines once (apps.tasks.logs).
"""

from __future__ import annotations

import asyncio
import logging
import operator
import re
import zlib
from functools import cache

import jsonschema_rs
from django.conf import settings

from apps.core.asgi import header
from apps.core.clock import utcnow
from apps.core.db import on_live_connection
from apps.core.enqueue import enqueue
from apps.core.error_codes import CoreErrorCode
from apps.core.redis import async_client
from apps.nodes.api.agent_route import AgentRoute, HttpError, orjson_or_400
from apps.tasks import logs

logger = logging.getLogger(__name__)
PATH = re.compile(r"^/api/v1/nodes/(?P<node_id>[^/]+)/logs/?$")
INFLATE_RATIO = 16  # a compressed body may grow to this many times the body limit, not more
REDIS_TIMEOUT = 2.0
# Batches worked on at once by one web process. Logs share the process with the
# heartbeats, and a batch is CPU work (tens of ms for a large one): past this, a batch
# waits its turn (the agent's next batch waits for this one's answer), so a flood of logs
# slows logs, not beats.
CONCURRENT_BATCHES = 1


class LogIngestApp(AgentRoute):
    path = PATH
    what = "a log batch"

    def __init__(self, fallback):
        super().__init__(fallback)
        self._turns: dict = {}  # event loop -> its semaphore

    def turn(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._turns:
            self._turns = {loop: asyncio.Semaphore(CONCURRENT_BATCHES)}  # one loop a process
        return self._turns[loop]

    def pool_size(self) -> int:
        return settings.HETEROFLOW_TASK_LOG_DB_POOL_SIZE

    def body_limit(self) -> int:
        return settings.HETEROFLOW_TASK_LOG_MAX_BODY_BYTES

    async def respond(self, scope, receive, node_id: str) -> tuple[int, dict]:
        self.check_request(scope, node_id)
        body = await self.body(scope, receive)
        encoding = (header(scope, b"content-encoding") or "identity").strip().lower()
        if encoding not in ("gzip", "identity"):
            raise HttpError(415, CoreErrorCode.UNSUPPORTED_MEDIA_TYPE, f"Content-Encoding {encoding!r}: use gzip.")
        async with self.turn():
            # a large batch takes tens of milliseconds to inflate, parse and check: in a
            # thread, so that the event loop goes on answering heartbeats meanwhile
            batches = await asyncio.to_thread(self.read, body, encoding)
            try:
                done = await on_live_connection(
                    await self.pool(), lambda conn: logs.ingest(conn, node_id, batches, utcnow())
                )
            except Exception:
                logger.exception("log batch of %s not stored", node_id)
                raise HttpError(503, CoreErrorCode.UNAVAILABLE, "The log batch could not be stored; retry.") from None
        await publish(done.published)
        for task_id in done.over_bound:  # the broker is Redis too: off the event loop
            asyncio.get_running_loop().run_in_executor(None, enqueue, "tasks.trim_logs", task_id)
        return 200, {"tasks": {str(key): value for key, value in done.next_by_task.items()}, "refused": done.refused}

    def read(self, body: bytes, encoding: str) -> list[logs.RunBatch]:
        if encoding == "gzip":
            body = inflate(body, self.body_limit() * INFLATE_RATIO)
        return read_batches(orjson_or_400(body), body)


async def publish(published: dict[int, list[bytes]]) -> None:
    """The stored lines to each task's followers. Redis away or slow: logged; followers
    read the table after their last line every few seconds, and find them there."""
    if not published:
        return
    try:
        async with asyncio.timeout(REDIS_TIMEOUT):
            async with async_client().pipeline(transaction=False) as pipe:
                for task_id, chunks in published.items():
                    for chunk in chunks:
                        pipe.publish(logs.channel(task_id), chunk)
                await pipe.execute()
    except Exception as exc:  # noqa: BLE001
        logger.warning("log lines of %d tasks stored but not published (followers read them): %s", len(published), exc)


def inflate(body: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit)
    except zlib.error as exc:
        raise HttpError(400, CoreErrorCode.PARSE_ERROR, f"The gzip body is damaged: {exc}.") from None
    if inflater.unconsumed_tail:
        raise HttpError(413, CoreErrorCode.PAYLOAD_TOO_LARGE, f"A log batch may inflate to at most {limit} bytes.")
    if not inflater.eof:  # cut short: no end of stream, no checksum to trust
        raise HttpError(400, CoreErrorCode.PARSE_ERROR, "The gzip body is damaged: it ends before its end.")
    return out


# The batch's shape, compiled once by jsonschema-rs (as the heartbeat's): a valid batch is
# checked in one call, with no line of Python per line. Only a batch it refuses, or one
# that needs cleaning (a NUL, an over-long line) or whose lines do not rise, is walked
# line by line (checked_batches), which names the bad field or cleans.
EPOCH_END = 32503680000  # the year 3000
BATCH_SCHEMA = {
    "type": "object",
    "required": ["tasks"],
    "properties": {
        "tasks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["task_id", "run", "lines"],
                "properties": {
                    "task_id": {"type": "integer", "minimum": 1},
                    "run": {"type": "string", "minLength": 1, "maxLength": 64},
                    "dropped_bytes": {"type": "integer", "minimum": 0},
                    "lines": {
                        "type": "array",
                        "items": {
                            "type": "array",
                            "minItems": 4,
                            "prefixItems": [
                                {"type": "integer", "minimum": 0, "maximum": 2**53},
                                {"type": "number", "minimum": 0, "exclusiveMaximum": EPOCH_END},
                                {"enum": list(logs.STREAMS)},
                                {"type": "string", "maxLength": logs.MAX_LINE_CHARS},
                            ],
                            "items": False,
                        },
                    },
                },
            },
        }
    },
}
_N = operator.itemgetter(0)


@cache
def _batch_validator():
    return jsonschema_rs.validator_for(BATCH_SCHEMA)


def read_batches(payload, body: bytes) -> list[logs.RunBatch]:
    """The batch's tasks, checked whole before anything is stored (HttpError 400 names
    the first bad field); `body` is the JSON text `payload` was read from."""
    if _batch_validator().is_valid(payload) and b"\\u0000" not in body:
        batches = [
            logs.RunBatch(item["task_id"], item["run"], item["lines"], item.get("dropped_bytes", 0))
            for item in payload["tasks"]
        ]
        if all(_numbered(batch.lines) for batch in batches):
            return batches
    return checked_batches(payload)


def _numbered(lines: list[list]) -> bool:
    """Whether the lines' n are whole numbers (the schema takes 2.0 for an integer) and
    rise: in C, not a Python step per line."""
    numbers = list(map(_N, lines))
    return type(sum(numbers)) is int and all(map(operator.lt, numbers, numbers[1:]))


def checked_batches(payload) -> list[logs.RunBatch]:
    """The batch walked line by line: the first bad field named (HttpError 400), NULs and
    over-long lines cleaned, and a line whose n does not rise above the one before it
    skipped, as a resend is."""

    def bad(where: str, why: str):
        return HttpError(400, CoreErrorCode.INVALID, f"Invalid log batch: {where}: {why}", {where: [why]})

    if not isinstance(payload, dict) or not isinstance(payload.get("tasks"), list):
        raise bad("tasks", "A list of each task's lines.")
    batches = []
    for i, item in enumerate(payload["tasks"]):
        where = f"tasks[{i}]"
        if not isinstance(item, dict):
            raise bad(where, "An object.")
        task_id, run, lines = item.get("task_id"), item.get("run"), item.get("lines")
        dropped = item.get("dropped_bytes", 0)
        if not isinstance(task_id, int) or isinstance(task_id, bool) or task_id <= 0:
            raise bad(f"{where}.task_id", "A positive integer.")
        if not isinstance(run, str) or not 0 < len(run) <= 64:
            raise bad(f"{where}.run", "1-64 characters.")
        if not isinstance(dropped, int) or isinstance(dropped, bool) or dropped < 0:
            raise bad(f"{where}.dropped_bytes", "A non-negative integer.")
        if not isinstance(lines, list):
            raise bad(f"{where}.lines", "A list of [n, at, stream, text].")
        parsed: list[list] = []
        for j, line in enumerate(lines):
            if not (isinstance(line, list) and len(line) == 4):
                raise bad(f"{where}.lines[{j}]", "[n, at, stream, text].")
            n, at, stream, text = line
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 2**53:
                raise bad(f"{where}.lines[{j}]", "n: a non-negative integer.")
            if not isinstance(at, (int, float)) or isinstance(at, bool) or not 0 <= at < EPOCH_END:
                raise bad(f"{where}.lines[{j}]", "at: seconds since the epoch.")
            if stream not in logs.STREAMS:
                raise bad(f"{where}.lines[{j}]", f"stream: one of {', '.join(logs.STREAMS)}.")
            if not isinstance(text, str):
                raise bad(f"{where}.lines[{j}]", "text: a string.")
            if not parsed or n > parsed[-1][0]:
                parsed.append([n, at, stream, logs.clean_text(text)])
        batches.append(logs.RunBatch(task_id, run, parsed, dropped))
    return batches
