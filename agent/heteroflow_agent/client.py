"""HTTP to the control plane, the agent's only way of talking: outbound, with the agent
key on every call.

Transient trouble (connection errors, timeouts, 5xx, 408, 429) is retried a bounded
number of times with exponential back-off (429 and 503 honour Retry-After up to the
cap); the caller then gives up until its next round, so nothing piles up. A 401 means
the key is wrong: retrying cannot fix that, so it is raised at once and logged once as a
configuration error, not on every beat.

A client made with a `deadline` bounds the whole call, not only each attempt: each
attempt's connect and read timeouts are clipped to the time left (urllib3's `total`, so
connecting and waiting for the answer together fit in it), no wait runs past it, and no
attempt starts after it. The one limit: each read waits at most what was left when the
attempt began, so a server that trickles its answer byte by byte can hold one attempt
longer.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import requests
from urllib3.util import Timeout

logger = logging.getLogger("heteroflow_agent.client")

RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class ServerError(RuntimeError):
    """The control plane could not be reached or kept failing; try again next round."""


class AuthError(ServerError):
    """401: the agent key does not match the control plane."""


class ServerClient:
    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        connect_timeout: float = 5.0,
        read_timeout: float = 15.0,
        attempts: int = 3,
        backoff: float = 0.5,
        backoff_cap: float = 8.0,
        deadline: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        user_agent: str = "heteroflow-agent",
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = (connect_timeout, read_timeout)
        self.attempts, self.backoff, self.backoff_cap = max(1, attempts), backoff, backoff_cap
        if deadline is not None and not deadline > 0:
            raise ValueError(f"a deadline of {deadline!r} s leaves no time for a call")
        self.deadline = deadline  # seconds for a whole call, attempts and waits together (None: unbounded)
        self.sleep, self.clock = sleep, clock
        self.session = requests.Session()
        self.session.headers.update({"X-API-Key": api_key, "User-Agent": user_agent, "Accept": "application/json"})
        self._auth_reported = False

    def request(
        self,
        method: str,
        path: str,
        *,
        json=None,
        params=None,
        expect=(200, 201),
        attempts: int | None = None,
        data: bytes | None = None,
        headers: dict | None = None,
    ) -> requests.Response:
        """The response when its status is in `expect` or is a client error other than
        401 (the caller decides what a 404 or 409 means). Raises AuthError on 401 and
        ServerError when the retries are spent or the client's deadline leaves no time
        for another."""
        url = self.base_url + path
        problem = ""
        attempts = attempts or self.attempts
        ends = None if self.deadline is None else self.clock() + self.deadline
        for attempt in range(1, attempts + 1):
            left = self._left(ends)
            if left == 0.0:  # a wait overslept into the deadline: no attempt starts after it
                raise ServerError(
                    f"{method} {path}: {problem} after {attempt - 1} attempts, at its {self.deadline:g} s deadline"
                )
            try:
                response = self.session.request(
                    method,
                    url,
                    json=json,
                    params=params,
                    data=data,
                    headers=headers,
                    timeout=self.timeout_within(left),
                )
            except requests.RequestException as exc:
                problem = f"{type(exc).__name__}: {exc}"
                delay = self._delay(attempt)
            else:
                if response.status_code == 401:
                    self._report_auth_failure(response)
                    raise AuthError(f"{method} {path}: 401, the agent key is not accepted")
                self._auth_reported = False  # accepted again: a later 401 is news
                if response.status_code not in RETRIED_STATUSES:
                    return response
                problem = f"HTTP {response.status_code}"
                delay = self._delay(attempt, response.headers.get("Retry-After"))
            if attempt == attempts:
                break
            if ends is not None and delay >= self._left(ends):  # the wait leaves no time for an attempt
                raise ServerError(
                    f"{method} {path}: {problem} after {attempt} attempts, at its {self.deadline:g} s deadline"
                )
            logger.debug("%s %s failed (%s); retry %d in %.1f s", method, path, problem, attempt, delay)
            self.sleep(delay)
        raise ServerError(f"{method} {path}: {problem} after {attempts} attempts")

    def timeout_within(self, left: float | None) -> tuple[float, float] | Timeout:
        """An attempt's timeouts: the client's own, clipped to `left` seconds (connecting
        and waiting for the answer together) when the call has a deadline."""
        if left is None:
            return self.timeout
        connect, read = self.timeout
        return Timeout(connect=min(connect, left), read=min(read, left), total=left)

    def _left(self, ends: float | None) -> float | None:
        return None if ends is None else max(ends - self.clock(), 0.0)

    def _delay(self, attempt: int, retry_after: str | None = None) -> float:
        if retry_after:
            try:
                return min(max(float(retry_after), 0.0), self.backoff_cap)
            except ValueError:
                pass
        base = min(self.backoff * 2 ** (attempt - 1), self.backoff_cap)
        return base * random.uniform(0.8, 1.2)  # jitter: a fleet restarted together does not retry in step

    def _report_auth_failure(self, response) -> None:
        if self._auth_reported:
            return
        self._auth_reported = True
        logger.error(
            "configuration error: the control plane at %s refuses the agent key (401). The agent keeps running "
            "but nothing will work until api_key matches the server's HETEROFLOW_AGENT_SECRET.",
            self.base_url,
        )

    def close(self) -> None:
        self.session.close()
