"""Limits, connection counts and the gateway's signals in Redis: one script call admits a
request (and picks its backend), one releases it. Atomic (Lua), so the limits hold across
gateway processes; nothing here cannot be lost (a lost Redis means each process holds
its own share of the limits for a while, `LocalLimits`, never wrong data in PostgreSQL).

Keys (`m` is the unix minute):
- `hf:gw:rpm:k:{key}:{m}`, `hf:gw:rpm:t:{tenant}:{m}`: requests this minute (fixed window);
- `hf:gw:tpm:k:{key}:{m}`, `hf:gw:tpm:t:{tenant}:{m}`: tokens (prompt + completion) this minute;
- `hf:gw:conc:k:{key}`, `hf:gw:conc:t:{tenant}`: sorted sets of the requests in flight
  (member: request id, score: start in ms), so a request whose process died stops
  counting after HETEROFLOW_GATEWAY_CONCURRENCY_TTL_SECONDS;
- `hf:gw:conns:{address}`: the same for a backend (least_connections reads it);
- `hf:gw:processes`: the live gateway processes (member: a process, score: its last beat
  in ms), the divisor of the limits while Redis is away;
- the Gateway signals of the inference services (read by the autoscaler; spelled in
  apps.inference.signal_keys): `hf:svc:{service}:inflight` (requests in flight) and
  `hf:svc:{service}:tokens:{m}` (completion tokens that minute, TTL 600 s).

A minute's request counter counts the requests admitted; a minute's token counter is
added to when a request ends, so a tokens-per-minute limit refuses the requests that
start after the minute's tokens reached it.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

from django.conf import settings
from redis.exceptions import NoScriptError

from apps.inference import signal_keys

WINDOW_SECONDS = 60
TOKENS_SIGNAL_TTL = 600
INFLIGHT_TTL = 900

ADMIT = """
local now = tonumber(ARGV[7])
local stale = now - tonumber(ARGV[9])
for i = 1, 4 do
  local limit = tonumber(ARGV[i])
  if limit > 0 and tonumber(redis.call('GET', KEYS[i]) or '0') >= limit then
    return {i <= 2 and 1 or 2, i}
  end
end
for i = 5, 6 do
  local limit = tonumber(ARGV[i])
  if limit > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', stale)
    if redis.call('ZCARD', KEYS[i]) >= limit then return {3, i} end
  end
end
for i = 1, 2 do
  if tonumber(ARGV[i]) > 0 and redis.call('INCR', KEYS[i]) == 1 then redis.call('EXPIRE', KEYS[i], 120) end
end
for i = 5, 6 do
  if tonumber(ARGV[i]) > 0 then
    redis.call('ZADD', KEYS[i], now, ARGV[8])
    redis.call('PEXPIRE', KEYS[i], ARGV[9])
  end
end
redis.call('INCR', KEYS[7])
redis.call('EXPIRE', KEYS[7], tonumber(ARGV[11]))
local n = #KEYS - 7
if n == 0 then return {0, 0} end
local offset = tonumber(ARGV[10])
local best, fewest = 0, nil
for j = 0, n - 1 do
  local index = (j + offset) % n
  local key = KEYS[8 + index]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', stale)
  local count = redis.call('ZCARD', key)
  if fewest == nil or count < fewest then best, fewest = index, count end
end
redis.call('ZADD', KEYS[8 + best], now, ARGV[8])
redis.call('PEXPIRE', KEYS[8 + best], ARGV[9])
return {0, best + 1}
"""

# Pick another backend for a request already admitted (a retry after a refused
# connection): drop it from the old backend's set, add it to the least loaded of KEYS[2..].
REPICK = """
if KEYS[1] ~= '' then redis.call('ZREM', KEYS[1], ARGV[1]) end
local now = tonumber(ARGV[2])
local stale = now - tonumber(ARGV[3])
local best, fewest = 0, nil
for i = 2, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', stale)
  local count = redis.call('ZCARD', KEYS[i])
  if fewest == nil or count < fewest then best, fewest = i, count end
end
if best == 0 then return -1 end
redis.call('ZADD', KEYS[best], now, ARGV[1])
redis.call('PEXPIRE', KEYS[best], ARGV[3])
return best - 2
"""

RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('DECR', KEYS[3]) < 0 then redis.call('SET', KEYS[3], 0) end
if KEYS[4] ~= '' then redis.call('ZREM', KEYS[4], ARGV[1]) end
local total = tonumber(ARGV[2])
if total > 0 then
  for i = 5, 6 do
    redis.call('INCRBY', KEYS[i], total)
    redis.call('EXPIRE', KEYS[i], 120)
  end
end
local completion = tonumber(ARGV[3])
if completion > 0 then
  redis.call('INCRBY', KEYS[7], completion)
  redis.call('EXPIRE', KEYS[7], tonumber(ARGV[4]))
end
return 1
"""

# what a refusal was about: (kind, which limit)
KIND = {1: "requests", 2: "tokens", 3: "concurrency"}
WHOSE = {1: "key", 2: "tenant", 3: "key", 4: "tenant", 5: "key", 6: "tenant"}


def minute(now_s: float) -> int:
    return int(now_s // WINDOW_SECONDS)


def retry_after(kind: str, now_s: float) -> int:
    """Seconds until the refused window resets (a concurrency refusal: try again in 1 s)."""
    if kind == "concurrency":
        return 1
    return max(1, int(WINDOW_SECONDS - now_s % WINDOW_SECONDS + 0.999))


def inflight_key(service_id: int) -> str:
    if service_id < 0:  # an external backend: not an inference service's signal
        return f"hf:gw:ext:{-service_id}:inflight"
    return signal_keys.inflight_key(service_id)


def tokens_key(service_id: int, unix_minute: int) -> str:
    if service_id < 0:
        return f"hf:gw:ext:{-service_id}:tokens:{unix_minute}"
    return signal_keys.tokens_key(service_id, unix_minute)


def conns_key(address: str) -> str:
    return f"hf:gw:conns:{address}"


CONNS_PREFIX = conns_key("")


def backend_in_flight(client, now_s: float) -> dict[str, int]:
    """address -> requests in flight to that backend, over every gateway process (the
    least-connections counts), read with a sync Redis `client` for /metrics; members older
    than the concurrency TTL (a process that died mid-request) do not count."""
    oldest_ms = int((now_s - settings.HETEROFLOW_GATEWAY_CONCURRENCY_TTL_SECONDS) * 1000)
    keys = list(client.scan_iter(match=CONNS_PREFIX + "*", count=500))
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.zcount(key, oldest_ms, "+inf")
        counts = pipe.execute()
    return {
        (key.decode() if isinstance(key, bytes) else key).removeprefix(CONNS_PREFIX): count
        for key, count in zip(keys, counts, strict=True)
        if count
    }


@dataclass(frozen=True)
class Admission:
    admitted: bool
    kind: str = ""  # requests | tokens | concurrency
    whose: str = ""  # key | tenant
    picked: int | None = None  # index into the candidates


def limit_keys(key_id: int, tenant_id: int, unix_minute: int) -> list[str]:
    return [
        f"hf:gw:rpm:k:{key_id}:{unix_minute}",
        f"hf:gw:rpm:t:{tenant_id}:{unix_minute}",
        f"hf:gw:tpm:k:{key_id}:{unix_minute}",
        f"hf:gw:tpm:t:{tenant_id}:{unix_minute}",
        f"hf:gw:conc:k:{key_id}",
        f"hf:gw:conc:t:{tenant_id}",
    ]


class Batcher:
    """Script calls made in one turn of the event loop go to Redis as one pipeline (one
    write, one read), not one round trip each: under load most requests' admissions and
    releases share a round trip. The scripts are loaded on first NOSCRIPT."""

    def __init__(self, client):
        self.client = client
        self.queue: list = []
        self.scheduled = False

    def call(self, script: str, keys, args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.queue.append((script, _sha(script), keys, args, future))
        if not self.scheduled:
            self.scheduled = True
            loop.create_task(self.flush())  # runs after this turn's other callbacks queued theirs
        return future

    async def flush(self) -> None:
        self.scheduled = False
        batch, self.queue = self.queue, []
        try:
            results = await self._run(batch)
            missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
            if missing:
                for script in {batch[i][0] for i in missing}:
                    await self.client.script_load(script)
                for i, result in zip(missing, await self._run([batch[i] for i in missing]), strict=True):
                    results[i] = result
        except Exception as exc:
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (*_, future), result in zip(batch, results, strict=True):
            if future.done():
                continue  # its caller timed out
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _run(self, batch) -> list:
        pipe = self.client.pipeline(transaction=False)
        for _, sha, keys, args, _ in batch:
            pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)


_SHAS: dict[str, str] = {}


def _sha(script: str) -> str:
    sha = _SHAS.get(script)
    if sha is None:
        sha = _SHAS[script] = hashlib.sha1(script.encode(), usedforsecurity=False).hexdigest()  # Redis EVALSHA names
    return sha


class Limits:
    """The three scripts, called through one batcher on one async Redis client."""

    def __init__(self, client, concurrency_ttl_s: int):
        self.batcher = Batcher(client)
        self.ttl_ms = concurrency_ttl_s * 1000

    async def admit(self, key, service_id: int, request_id: str, candidates: list[str], now_s: float, offset: int):
        keys = limit_keys(key.id, key.tenant_id, minute(now_s))
        keys.append(inflight_key(service_id))
        keys.extend(conns_key(address) for address in candidates)
        args = [
            key.rpm_limit or 0,
            key.tenant_rpm_limit or 0,
            key.tpm_limit or 0,
            key.tenant_tpm_limit or 0,
            key.concurrency_limit or 0,
            key.tenant_concurrency_limit or 0,
            int(now_s * 1000),
            request_id,
            self.ttl_ms,
            offset,
            INFLIGHT_TTL,
        ]
        code, detail = await self.batcher.call(ADMIT, keys, args)
        if code:
            return Admission(False, KIND[int(code)], WHOSE[int(detail)])
        return Admission(True, picked=int(detail) - 1 if int(detail) else None)

    async def repick(self, request_id: str, old: str | None, candidates: list[str], now_s: float) -> int | None:
        keys = [conns_key(old) if old else "", *(conns_key(a) for a in candidates)]
        picked = await self.batcher.call(REPICK, keys, [request_id, int(now_s * 1000), self.ttl_ms])
        return None if int(picked) < 0 else int(picked)

    async def release(
        self,
        key,
        service_id: int,
        request_id: str,
        backend: str | None,
        now_s: float,
        *,
        total_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        rpm_k, rpm_t, tpm_k, tpm_t, conc_k, conc_t = limit_keys(key.id, key.tenant_id, minute(now_s))
        keys = [
            conc_k,
            conc_t,
            inflight_key(service_id),
            conns_key(backend) if backend else "",
            tpm_k,
            tpm_t,
            tokens_key(service_id, minute(now_s)),
        ]
        await self.batcher.call(
            RELEASE, keys, [request_id, int(total_tokens), int(completion_tokens), TOKENS_SIGNAL_TTL]
        )


# --- while Redis is away ------------------------------------------------------------------
# Every process says it is alive in one sorted set (member: the process, score: its last
# beat in ms) while Redis is up; the count of the members younger than PROCESS_STALE is
# what the process divides each limit by once Redis is away.

PROCESSES_KEY = "hf:gw:processes"
PROCESS_BEAT_SECONDS = 5.0
PROCESS_STALE_SECONDS = 15.0


async def count_processes(client, process_id: str, now_s: float) -> int:
    """Say this process is alive and count the live gateway processes (itself included)."""
    now_ms = int(now_s * 1000)
    stale_ms = int(PROCESS_STALE_SECONDS * 1000)
    pipe = client.pipeline(transaction=True)
    pipe.zadd(PROCESSES_KEY, {process_id: now_ms})
    pipe.zremrangebyscore(PROCESSES_KEY, "-inf", now_ms - stale_ms)
    pipe.zcard(PROCESSES_KEY)
    pipe.pexpire(PROCESSES_KEY, 2 * stale_ms)
    return max(1, int((await pipe.execute())[2]))


class LocalLimits:
    """This process's own counts, kept on every admission whether Redis admitted it or not:
    requests and tokens this minute and requests in flight, per key ("k", id) and per
    tenant ("t", id). While Redis is away, `admit` holds each limit at this process's
    share, `limit // divisor` (at least 1), where the divisor is the count of gateway
    processes last seen; what the process admitted earlier in the minute through Redis
    counts, so a minute that Redis leaves halfway is not a fresh one."""

    __slots__ = ("requests", "tokens", "in_flight", "divisor")

    def __init__(self):
        self.requests: dict[tuple[str, int], list[int]] = {}  # [minute, count]
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.in_flight: dict[tuple[str, int], int] = {}
        self.divisor = 1

    def share(self, limit: int) -> int:
        return max(1, limit // self.divisor)

    @staticmethod
    def _this_minute(counts: dict, subject, unix_minute: int) -> int:
        entry = counts.get(subject)
        return entry[1] if entry is not None and entry[0] == unix_minute else 0

    @staticmethod
    def _add(counts: dict, subject, unix_minute: int, amount: int) -> None:
        entry = counts.get(subject)
        if entry is None or entry[0] != unix_minute:
            counts[subject] = [unix_minute, amount]
        else:
            entry[1] += amount

    def admit(self, key, now_s: float) -> Admission:
        """Without Redis: the first limit this process's share of is reached refuses."""
        unix_minute = minute(now_s)
        subjects = (("k", key.id), ("t", key.tenant_id))
        checks = (
            ("requests", self.requests, (key.rpm_limit, key.tenant_rpm_limit)),
            ("tokens", self.tokens, (key.tpm_limit, key.tenant_tpm_limit)),
        )
        for kind, counts, limits in checks:
            for subject, limit in zip(subjects, limits, strict=True):
                if limit and self._this_minute(counts, subject, unix_minute) >= self.share(limit):
                    return Admission(False, kind, "key" if subject[0] == "k" else "tenant")
        for subject, limit in zip(subjects, (key.concurrency_limit, key.tenant_concurrency_limit), strict=True):
            if limit and self.in_flight.get(subject, 0) >= self.share(limit):
                return Admission(False, "concurrency", "key" if subject[0] == "k" else "tenant")
        self.started(key, now_s)
        return Admission(True)

    def started(self, key, now_s: float) -> None:
        unix_minute = minute(now_s)
        for subject in (("k", key.id), ("t", key.tenant_id)):
            self._add(self.requests, subject, unix_minute, 1)
            self.in_flight[subject] = self.in_flight.get(subject, 0) + 1

    def ended(self, key, now_s: float, total_tokens: int) -> None:
        unix_minute = minute(now_s)
        for subject in (("k", key.id), ("t", key.tenant_id)):
            left = self.in_flight.get(subject, 0) - 1
            if left > 0:
                self.in_flight[subject] = left
            else:
                self.in_flight.pop(subject, None)
            if total_tokens > 0:
                self._add(self.tokens, subject, unix_minute, total_tokens)

    def clean(self, now_s: float) -> None:
        """Drop the counts of minutes past (what a long-running process would keep forever)."""
        unix_minute = minute(now_s)
        for counts in (self.requests, self.tokens):
            for subject in [s for s, (m, _) in counts.items() if m != unix_minute]:
                del counts[subject]
