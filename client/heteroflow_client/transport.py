"""HTTP to the control plane (httpx): the bearer key, the API's error body turned into
the client's exceptions, and a few retries where a retry is safe (429 with Retry-After,
a connection refused before anything was sent)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx

from heteroflow_client._version import __version__
from heteroflow_client.config import LOGIN_HINT
from heteroflow_client.errors import ApiError, AuthError, ConnectionFailed, NotFound

API = "/api/v1"
USER_AGENT = f"heteroflow-client/{__version__}"


def describe(exc: BaseException) -> str:
    """A transport failure in words ("connection refused", "timed out"…)."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({text})"
    cause = exc.__cause__ or exc.__context__
    while cause is not None and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror.lower()
    return re.sub(r"^\[Errno -?\d+\] ", "", text).lower() if text.startswith("[Errno") else text


def api_error(response: httpx.Response, method: str = "", path: str = "") -> ApiError:
    """The API's `{"error": {"code", "message", "fields"}}` as an exception."""
    status = response.status_code
    code, message, fields = "error", "", {}
    try:
        body = response.json()
    except (ValueError, httpx.ResponseNotRead):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        code = str(error.get("code") or code)
        message = str(error.get("message") or "")
        fields = error.get("fields") or {}
    if not message:
        try:
            text = response.text.strip()
        except httpx.ResponseNotRead:
            text = ""
        message = text[:300] or response.reason_phrase or f"HTTP {status}"
    if status == 401:
        return AuthError(f"{message} ({code}): {LOGIN_HINT}")  # type: ignore[return-value]
    cls = NotFound if status == 404 else ApiError
    return cls(status, code, message, fields, method=method, path=path)


class Transport:
    def __init__(
        self,
        url: str,
        key: str | None,
        *,
        timeout: float = 30.0,
        retries: int = 3,
        debug: bool = False,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self.key = key
        self.retries = retries
        self.debug = debug
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout, follow_redirects=False, transport=transport
        )

    def close(self) -> None:
        self.http.close()

    def _log(self, text: str) -> None:
        if self.debug:
            import sys

            print(f"[hf] {text}", file=sys.stderr)

    def send(
        self,
        method: str,
        path: str,
        *,
        params: dict | None = None,
        json_body: Any = None,
        headers: dict | None = None,
        ok: tuple[int, ...] = (),
    ) -> httpx.Response:
        """One request; a status in `ok` (besides 2xx) is returned, any other error raised."""
        path = path if path.startswith("/") else f"{API}/{path}"
        params = {k: v for k, v in (params or {}).items() if v is not None}
        attempt = 0
        while True:
            attempt += 1
            started = time.monotonic()
            try:
                response = self.http.request(method, path, params=params, json=json_body, headers=headers)
            except httpx.ConnectError as exc:
                # nothing was sent: safe to try again, briefly, for any method
                if attempt <= self.retries:
                    self._log(f"{method} {path}: {describe(exc)}; retrying")
                    time.sleep(0.2 * attempt)
                    continue
                raise ConnectionFailed(self.url, describe(exc)) from exc
            except httpx.HTTPError as exc:
                raise ConnectionFailed(self.url, describe(exc)) from exc
            self._log(
                f"{method} {response.url} -> {response.status_code} ({(time.monotonic() - started) * 1000:.0f} ms)"
            )
            if response.status_code == 429 and attempt <= self.retries:
                wait = min(float(response.headers.get("Retry-After") or 1), 10.0)
                self._log(f"throttled; retrying in {wait:.0f} s")
                time.sleep(wait)
                continue
            if response.is_success or response.status_code in ok:
                return response
            raise api_error(response, method, path)

    def get(self, path: str, **params: Any) -> Any:
        return self.send("GET", path, params=params).json()

    def post(self, path: str, body: Any = None, **params: Any) -> Any:
        response = self.send("POST", path, params=params, json_body=body if body is not None else {})
        return response.json() if response.content else None

    def patch(self, path: str, body: Any) -> Any:
        return self.send("PATCH", path, json_body=body).json()

    def delete(self, path: str) -> None:
        self.send("DELETE", path)

    def pages(self, path: str, *, limit: int = 500, **params: Any) -> Iterator[dict]:
        """Every item of a paged list, page by page."""
        offset = 0
        while True:
            page = self.get(path, limit=limit, offset=offset, **params)
            results = page.get("results", [])
            yield from results
            if not page.get("next") or not results:
                return
            offset += len(results)

    def stream(self, path: str, *, params: dict | None = None, headers: dict | None = None, timeout=None):
        """A streamed GET (the caller closes it): for server-sent events."""
        path = path if path.startswith("/") else f"{API}/{path}"
        request = self.http.build_request(
            "GET", path, params={k: v for k, v in (params or {}).items() if v is not None}, headers=headers
        )
        if timeout is not None:
            request.extensions["timeout"] = httpx.Timeout(timeout).as_dict()
        try:
            return self.http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise ConnectionFailed(self.url, describe(exc)) from exc
