"""Rate limits on the API (docs/security.md#rate-limits).

One fixed-window counter per principal in Redis (Django's cache): `INCR` of a key named
after the principal and the window, which expires with the window, so every instance of
the control plane counts into the same counter and a Redis restart only starts the
windows afresh. A caller over its rate gets 429 with `Retry-After` (the seconds until its
window ends).

- People and their keys (operators, tenant users, tenant keys): HETEROFLOW_API_RATE per
  key, or per user for a signed-in session.
- The agent key is one secret shared by the whole fleet, so it is never counted as one
  principal: an agent's request is counted per node id, the one it names (`node_id` in
  the query, as the task poll and reads send it) at HETEROFLOW_API_RATE_AGENT_NODE;
  an agent request that names none (a task report, an event) is not counted. The
  heartbeat is a thin ASGI route (apps.nodes.api.heartbeat) outside DRF and is not
  counted either: one beat per node every few seconds is the fleet working.
- Requests without valid credentials are refused (401/403) before any counting.

If Redis cannot be reached the request is let through (logged): a limiter must not
take the API down with it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass

from django.conf import settings
from django.core.cache import cache
from rest_framework import exceptions
from rest_framework.throttling import BaseThrottle

from heteroflow.rates import Rate

logger = logging.getLogger(__name__)


def now() -> float:
    """The time source of every window (tests move it with time-machine)."""
    return time.time()


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    count: int
    retry_after: int  # seconds until the window ends (meaningful when not allowed)


def hit(scope: str, ident: str, rate: Rate, *, at: float | None = None) -> Verdict:
    """Count one request of `ident` in its current window; allowed while the count is
    within the rate."""
    if rate.unlimited:
        return Verdict(True, 0, 0)
    at = now() if at is None else at
    window = int(at // rate.period)
    counter = f"rl:{scope}:{_digest(ident)}:{rate.period}:{window}"
    try:
        # kept past its window's end, so that an instance whose clock is a little behind
        # never finds it gone mid-window (Django's incr is EXISTS then INCR)
        count = incr(counter, timeout=2 * rate.period + 5)
    except Exception:  # the limiter fails open; the cause is logged
        logger.warning("rate limit %s not counted: the cache is unreachable", scope, exc_info=True)
        return Verdict(True, 0, 0)
    retry_after = max(1, math.ceil((window + 1) * rate.period - at))
    return Verdict(count <= rate.count, count, retry_after)


def incr(key: str, timeout: int) -> int:
    """INCR of a counter that expires `timeout` seconds after its first count."""
    try:
        return cache.incr(key)
    except ValueError:  # not there yet: the window's first request
        if cache.add(key, 1, timeout=timeout):
            return 1
        return cache.incr(key)  # another request created it in between


def _digest(ident: str) -> str:
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def principal_bucket(principal, node_id: str | None = None) -> tuple[str, str, Rate] | None:
    """(scope, identity, rate) that a request of `principal` counts in, or None when it
    is not counted."""
    if getattr(principal, "kind", None) is None:  # no Principal (apps.core.principals)
        return None
    if principal.is_agent:
        if not node_id:
            return None
        return "agent-node", str(node_id), settings.HETEROFLOW_API_RATE_AGENT_NODE
    if principal.api_key is not None:
        return "api", f"key:{principal.api_key.pk}", settings.HETEROFLOW_API_RATE
    if principal.user is not None:
        return "api", f"user:{principal.user.pk}", settings.HETEROFLOW_API_RATE
    return None


def check_principal(principal, node_id: str | None = None) -> None:
    """Raise Throttled (429, Retry-After) when `principal` is over its rate."""
    bucket = principal_bucket(principal, node_id)
    if bucket is None:
        return
    scope, ident, rate = bucket
    verdict = hit(scope, ident, rate)
    if not verdict.allowed:
        if verdict.count == rate.count + 1:  # once per window, not per refused request
            logger.warning("rate limit: %s %s over %d/%ds", scope, ident, rate.count, rate.period)
        raise exceptions.Throttled(wait=verdict.retry_after)


class PrincipalRateThrottle(BaseThrottle):
    """DRF's throttle hook for check_principal (REST_FRAMEWORK's DEFAULT_THROTTLE_CLASSES)."""

    def allow_request(self, request, view):
        node_id = request.query_params.get("node_id")
        try:
            check_principal(request.auth, node_id)
        except exceptions.Throttled as exc:
            self._wait = exc.wait
            return False
        return True

    def wait(self):
        return getattr(self, "_wait", None)
