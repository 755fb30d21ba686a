"""The gateway's load readings for the AutoScaler and the sleep check (its signal keys,
read from Redis), and the AutoScaler's short memory of its samples.

The gateway writes (SERVICES.md, "Gateway signals"; the keys: apps.inference.signal_keys):
- `hf:svc:{service_id}:inflight`: requests in flight, queued ones included;
- `hf:svc:{service_id}:tokens:{unix_minute}`: completion tokens that minute (TTL 600 s).
A key that is absent is no reading (None), never 0: the gateway may be down, and missing
data never scales down nor puts a service to sleep. Tokens per second are the last whole
minute's count over 60.

Each round's sample is kept in `hf:svc:{service_id}:samples` (a list, newest first, as
long as the longest stabilisation plus a sample's age, and expiring with it), so that
autoscale.decide sees the series, not one reading.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

import redis

from apps.core.redis import client as redis_client
from apps.inference import autoscale
from apps.inference.signal_keys import inflight_key, samples_key, tokens_key

logger = logging.getLogger(__name__)

SAMPLES_KEPT_SECONDS = 3_600  # beyond any stabilisation a policy may reasonably have
SAMPLES_KEPT = 240  # 2 hours of 30 s rounds at most


def client() -> redis.Redis:
    """A client of its own (callers close it with `with`), with apps.core.redis's bounds."""
    return redis.Redis(connection_pool=redis_client().connection_pool)


@dataclass(frozen=True)
class Reading:
    in_flight: int | None = None
    tokens_per_s: float | None = None


def _int(value) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def read(service_ids, now: datetime) -> dict[int, Reading]:
    """service id -> its gateway reading now, for every service in one round trip; Redis
    away: no reading for any (nothing scales down, nothing sleeps)."""
    ids = list(service_ids)
    if not ids:
        return {}
    minute = int(now.timestamp()) // 60 - 1  # the last whole minute
    try:
        with client() as connection:
            pipe = connection.pipeline(transaction=False)
            for pk in ids:
                pipe.get(inflight_key(pk))
                pipe.get(tokens_key(pk, minute))
            values = pipe.execute()
    except redis.RedisError:
        logger.warning("could not read the gateway's signals", exc_info=True)
        return {pk: Reading() for pk in ids}
    found = {}
    for index, pk in enumerate(ids):
        in_flight, tokens = _int(values[2 * index]), _int(values[2 * index + 1])
        found[pk] = Reading(
            in_flight=max(in_flight, 0) if in_flight is not None else None,
            tokens_per_s=tokens / 60 if tokens is not None else None,
        )
    return found


def _encode(sample: autoscale.Sample) -> str:
    return json.dumps(
        {
            "at": sample.at.timestamp(),
            "in_flight": sample.in_flight,
            "queued": sample.queued,
            "tokens_per_s": sample.tokens_per_s,
            "gpu_utilisation": sample.gpu_utilisation,
        }
    )


def _decode(raw) -> autoscale.Sample | None:
    try:
        data = json.loads(raw)
        return autoscale.Sample(
            at=datetime.fromtimestamp(data["at"], UTC),
            in_flight=data.get("in_flight"),
            queued=data.get("queued"),
            tokens_per_s=data.get("tokens_per_s"),
            gpu_utilisation=data.get("gpu_utilisation"),
        )
    except (ValueError, KeyError, TypeError):
        return None


def remember_all(samples: dict[int, autoscale.Sample], now: datetime) -> dict[int, list[autoscale.Sample]]:
    """Add each service's sample of this round to its series and return the series
    (oldest first, within SAMPLES_KEPT_SECONDS of `now`), for every service in one round
    trip. Redis away: each sample alone."""
    if not samples:
        return {}
    ids = list(samples)
    try:
        with client() as connection:
            pipe = connection.pipeline(transaction=False)
            for pk in ids:
                key = samples_key(pk)
                pipe.lpush(key, _encode(samples[pk]))
                pipe.ltrim(key, 0, SAMPLES_KEPT - 1)
                pipe.expire(key, SAMPLES_KEPT_SECONDS)
                pipe.lrange(key, 0, -1)
            replies = pipe.execute()
    except redis.RedisError:
        logger.warning("could not keep the autoscaler's samples", exc_info=True)
        return {pk: [sample] for pk, sample in samples.items()}
    found = {}
    for index, pk in enumerate(ids):
        series = [s for s in (_decode(item) for item in replies[4 * index + 3]) if s is not None]
        found[pk] = sorted(
            (s for s in series if s.at <= now and (now - s.at).total_seconds() <= SAMPLES_KEPT_SECONDS),
            key=lambda s: s.at,
        )
    return found


def forget(service_id: int) -> None:
    """Drop the service's series (tests; a service deleted)."""
    with client() as connection:
        connection.delete(samples_key(service_id))
