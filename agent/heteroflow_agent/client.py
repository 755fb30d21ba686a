"""HTTP to the control plane, the agent's only way of talking: outbound, with the agent
key on every call.

Transient trouble (connection errors, timeouts, 5xx, 408, 429) is retried a bounded
number of times with exponential back-off (429 and 503 honour Retry-After up to the
cap); the caller then gives up until its next round, so nothing piles up. A 401 means
the key is wrong: retrying cannot fix that, so it is raised at once and logged once as a
configuration error, not on every beat.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import requests

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
        sleep: Callable[[float], None] = time.sleep,
        user_agent: str = "heteroflow-agent",
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = (connect_timeout, read_timeout)
        self.attempts, self.backoff, self.backoff_cap = max(1, attempts), backoff, backoff_cap
        self.sleep = sleep
        self.session = requests.Session()
        self.session.headers.update({"X-API-Key": api_key, "User-Agent": user_agent, "Accept": "application/json"})
        self._auth_reported = False

    def request(
        self, method: str, path: str, *, json=None, params=None, expect=(200, 201), attempts: int | None = None
    ) -> requests.Response:
        """The response when its status is in `expect` or is a client error other than
        401 (the caller decides what a 404 or 409 means). Raises AuthError on 401 and
        ServerError when the retries are spent."""
        url = self.base_url + path
        problem = ""
        attempts = attempts or self.attempts
        for attempt in range(1, attempts + 1):
            try:
                response = self.session.request(method, url, json=json, params=params, timeout=self.timeout)
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
            if attempt < attempts:
                logger.debug("%s %s failed (%s); retry %d in %.1f s", method, path, problem, attempt, delay)
                self.sleep(delay)
        raise ServerError(f"{method} {path}: {problem} after {attempts} attempts")

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
