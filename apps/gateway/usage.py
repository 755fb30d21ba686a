"""Metering off the request path: the tokens of an answer (its `usage`), and the batched
writes of what requests leave behind: a key's last use, a service's last request (the
sleep policy reads it) and the usage buckets (per key, model, service and minute). Each
process gathers them in memory and writes them every HETEROFLOW_GATEWAY_FLUSH_SECONDS
(2 s: what a SIGKILL loses) and at shutdown, in three statements, on a task of its own."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import defaultdict
from datetime import UTC, datetime

import orjson
from django.conf import settings

from apps.gateway.catalog import LAST_REQUEST_SQL, LAST_USED_SQL

logger = logging.getLogger(__name__)

PARSED_BODY_MAX = 8 * 1024 * 1024
USAGE_EVENT = re.compile(rb"data: *(\{[^\n]*\"usage\"[^\n]*\})\s*(?:\n|$)")

USAGE_SQL = """
INSERT INTO gateway_usage (tenant_id, key_id, model, service_id, minute, requests, errors,
                           prompt_tokens, completion_tokens)
SELECT v.* FROM unnest(%s::bigint[], %s::bigint[], %s::text[], %s::bigint[], %s::timestamptz[], %s::int[],
                       %s::int[], %s::bigint[], %s::bigint[])
         AS v(tenant_id, key_id, model, service_id, minute, requests, errors, prompt_tokens, completion_tokens)
JOIN gateway_endpoint_keys k ON k.id = v.key_id AND k.tenant_id = v.tenant_id  -- a key deleted meanwhile: dropped
ON CONFLICT (tenant_id, key_id, model, service_id, minute) DO UPDATE SET
    requests = gateway_usage.requests + EXCLUDED.requests,
    errors = gateway_usage.errors + EXCLUDED.errors,
    prompt_tokens = gateway_usage.prompt_tokens + EXCLUDED.prompt_tokens,
    completion_tokens = gateway_usage.completion_tokens + EXCLUDED.completion_tokens
"""


def _tokens(usage) -> tuple[int, int]:
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    prompt = prompt if isinstance(prompt, int) and prompt >= 0 else 0
    completion = completion if isinstance(completion, int) and completion >= 0 else 0
    return prompt, completion


def usage_of_body(payload: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens of a whole answer; (0, 0) without a usage."""
    if not payload or len(payload) > PARSED_BODY_MAX or b'"usage"' not in payload:
        return 0, 0
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return 0, 0
    return _tokens(data.get("usage") if isinstance(data, dict) else None)


def usage_of_stream(tail: bytes, events: int) -> tuple[int, int]:
    """(prompt, completion) tokens of a stream, from the last event with a `usage` (an
    engine sends it at the end when asked, `stream_options.include_usage`, and some do
    anyway); without one, the completion is counted as one token per content event (the
    engines send one token per event), the prompt as unknown (0)."""
    for match in reversed(USAGE_EVENT.findall(tail)):
        try:
            event = orjson.loads(match)
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict) and isinstance(event.get("usage"), dict):
            return _tokens(event["usage"])
    done = 1 if b"data: [DONE]" in tail else 0
    return 0, max(0, events - done)


def minute_of(now_s: float) -> datetime:
    return datetime.fromtimestamp(now_s - now_s % 60, UTC)


class Meter:
    def __init__(self, catalog):
        self.catalog = catalog
        self.last_used: dict[int, datetime] = {}
        self.last_request: dict[int, datetime] = {}
        self.buckets: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self._flushed = time.monotonic()
        self._flushing: asyncio.Task | None = None

    def key_used(self, key_id: int) -> None:
        self.last_used[key_id] = datetime.now(UTC)

    def requested(self, service_id: int) -> None:
        if service_id > 0:  # an inference service (an external backend has no last_request_at)
            self.last_request[service_id] = datetime.now(UTC)

    def _count(self, key, model, service_id, *, error: bool, prompt: int = 0, completion: int = 0) -> None:
        service_id = service_id if service_id > 0 else None  # an external backend's usage: no service
        bucket = self.buckets[(key.tenant_id, key.id, str(model)[:200], service_id, minute_of(time.time()))]
        bucket[0] += 1
        bucket[1] += int(error)
        bucket[2] += prompt
        bucket[3] += completion
        self.maybe_flush()

    def refused(self, key, model, service_id) -> None:
        self._count(key, model, service_id, error=True)

    def done(self, key, model, service_id, outcome) -> None:
        self._count(
            key,
            model,
            service_id,
            error=outcome.error,
            prompt=outcome.prompt_tokens,
            completion=outcome.completion_tokens,
        )

    def pending(self) -> bool:
        return bool(self.buckets or self.last_used or self.last_request)

    def maybe_flush(self) -> None:
        if time.monotonic() - self._flushed < settings.HETEROFLOW_GATEWAY_FLUSH_SECONDS:
            return
        if self._flushing is not None and not self._flushing.done():
            return
        self._flushed = time.monotonic()
        self._flushing = asyncio.get_running_loop().create_task(self.flush())

    async def flush(self) -> None:
        """Write what was gathered; what could not be written is kept for the next flush."""
        last_used, self.last_used = self.last_used, {}
        last_request, self.last_request = self.last_request, {}
        buckets, self.buckets = self.buckets, defaultdict(lambda: [0, 0, 0, 0])
        try:
            if last_used:
                await self.catalog.execute(LAST_USED_SQL, (list(last_used), list(last_used.values())))
            if last_request:
                await self.catalog.execute(LAST_REQUEST_SQL, (list(last_request), list(last_request.values())))
            if buckets:
                rows = [(*where, *counts) for where, counts in buckets.items()]
                await self.catalog.execute(USAGE_SQL, [list(column) for column in zip(*rows, strict=True)])
        except Exception:
            logger.warning("could not write the gateway's usage; kept for the next flush", exc_info=True)
            for key_id, at in last_used.items():
                self.last_used.setdefault(key_id, at)
            for service_id, at in last_request.items():
                self.last_request.setdefault(service_id, at)
            for where, counts in buckets.items():
                kept = self.buckets[where]
                for i, value in enumerate(counts):
                    kept[i] += value
