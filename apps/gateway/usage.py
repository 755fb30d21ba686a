"""Metering: the tokens of an answer (its `usage`), a request's GPU-seconds (its share of
its replica's cards while it held them: `ShareClock`), and, off the request path, the
batched writes of what requests leave behind: a key's last use, a service's last request
(the sleep policy reads it) and the usage buckets (per key, model, service and minute).
Each process gathers them in memory and writes them every HETEROFLOW_GATEWAY_FLUSH_SECONDS
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
                           prompt_tokens, completion_tokens, gpu_seconds)
SELECT v.* FROM unnest(%s::bigint[], %s::bigint[], %s::text[], %s::bigint[], %s::timestamptz[], %s::int[],
                       %s::int[], %s::bigint[], %s::bigint[], %s::float8[])
         AS v(tenant_id, key_id, model, service_id, minute, requests, errors, prompt_tokens, completion_tokens,
              gpu_seconds)
JOIN gateway_endpoint_keys k ON k.id = v.key_id AND k.tenant_id = v.tenant_id  -- a key deleted meanwhile: dropped
ON CONFLICT (tenant_id, key_id, model, service_id, minute) DO UPDATE SET
    requests = gateway_usage.requests + EXCLUDED.requests,
    errors = gateway_usage.errors + EXCLUDED.errors,
    prompt_tokens = gateway_usage.prompt_tokens + EXCLUDED.prompt_tokens,
    completion_tokens = gateway_usage.completion_tokens + EXCLUDED.completion_tokens,
    gpu_seconds = gateway_usage.gpu_seconds + EXCLUDED.gpu_seconds
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


class ShareClock:
    """One replica's GPU-seconds, shared among the requests it serves at once, in this
    process. Its reading advances by cards / in-flight per second while requests are in
    flight, so a request's GPU-seconds are the reading at its end minus the reading at
    its start: exact for any overlap, two float operations a start or an end, no list of
    requests. Four 1-s requests at once on a 1-card replica come to 1 GPU-second
    together, a lone 1-s request on a 2-card replica to 2.

    Each gateway process counts only the requests it sent: with several processes in
    front of one replica each sees fewer in flight than the replica serves, so the sum
    over processes is more than the replica's cards for the time (docs/gateway.md)."""

    __slots__ = ("cards", "in_flight", "last", "reading")

    def __init__(self):
        self.cards = 0.0
        self.in_flight = 0
        self.last = 0.0
        self.reading = 0.0

    def _advance(self, now: float) -> None:
        if self.in_flight:
            self.reading += self.cards * (now - self.last) / self.in_flight
        self.last = now

    def start(self, now: float, cards: float) -> float:
        """A request sent to the replica (holding `cards` from now on): the reading to
        give back to `end`."""
        self._advance(now)
        self.cards = cards
        self.in_flight += 1
        return self.reading

    def end(self, now: float, started: float) -> float:
        """The request that started at reading `started` is over: its GPU-seconds."""
        self._advance(now)
        self.in_flight -= 1
        spent = self.reading - started
        if not self.in_flight:
            self.reading = 0.0  # nobody holds an older reading: keep the numbers small
        return spent


class ShareClocks:
    """The process's share clocks, one per replica address."""

    def __init__(self):
        self._clocks: dict[str, ShareClock] = {}

    def of(self, address: str) -> ShareClock:
        clock = self._clocks.get(address)
        if clock is None:
            clock = self._clocks[address] = ShareClock()
        return clock

    def clean(self) -> None:
        """Drop the clocks with nothing in flight (replicas gone or idle: made anew when used)."""
        for address in [a for a, clock in self._clocks.items() if not clock.in_flight]:
            del self._clocks[address]

    def __len__(self) -> int:
        return len(self._clocks)


def new_bucket() -> list:
    return [0, 0, 0, 0, 0.0]


class Meter:
    def __init__(self, catalog):
        self.catalog = catalog
        self.last_used: dict[int, datetime] = {}
        self.last_request: dict[int, datetime] = {}
        # requests, errors, prompt tokens, completion tokens, GPU-seconds
        self.buckets: dict[tuple, list] = defaultdict(new_bucket)
        self._flushed = time.monotonic()
        self._flushing: asyncio.Task | None = None

    def key_used(self, key_id: int) -> None:
        self.last_used[key_id] = datetime.now(UTC)

    def requested(self, service_id: int) -> None:
        if service_id > 0:  # an inference service (an external backend has no last_request_at)
            self.last_request[service_id] = datetime.now(UTC)

    def _count(
        self, key, model, service_id, *, error: bool, prompt: int = 0, completion: int = 0, gpu_seconds: float = 0.0
    ) -> None:
        service_id = service_id if service_id > 0 else None  # an external backend's usage: no service
        bucket = self.buckets[(key.tenant_id, key.id, str(model)[:200], service_id, minute_of(time.time()))]
        bucket[0] += 1
        bucket[1] += int(error)
        bucket[2] += prompt
        bucket[3] += completion
        bucket[4] += gpu_seconds
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
            gpu_seconds=outcome.gpu_seconds,
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
        buckets, self.buckets = self.buckets, defaultdict(new_bucket)
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
