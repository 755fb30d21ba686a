"""A stand-in HeteroFlow API for the client's unit tests: a real HTTP server on 127.0.0.1
(a thread), whose answers each test writes as handlers, and which records every request
it got. The job schema it serves is the real server's (apps.core.jobs_schema), so the
client is checked against what the control plane publishes."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, urlsplit

KEY = "sk-tenant-unit-tests-only"


@dataclass
class Request:
    method: str
    path: str
    query: dict
    headers: dict
    body: object | None


@dataclass
class Answer:
    status: int = 200
    body: object = None
    headers: dict = field(default_factory=dict)


def error(status: int, code: str, message: str, fields: dict | None = None) -> Answer:
    return Answer(status, {"error": {"code": code, "message": message, "fields": fields or {}}})


def jobs_schema() -> tuple[dict, str]:
    from apps.core import jobs_schema as server_schema
    from apps.core.api.schemas import SOURCES

    published = server_schema.published(SOURCES)
    return published.schema, published.etag


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a connection a test cut on purpose


class FakeAPI:
    """`routes` maps (METHOD, path regex) to handler(request, match) -> Answer, or to a
    streaming handler(request, match, handler) that writes the raw response itself."""

    def __init__(self, port: int = 0):
        self.routes: dict[tuple[str, str], Callable] = {}
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.schema, self.etag = jobs_schema()
        self.route("GET", r"/api/v1/schemas/jobs", self.serve_schema)
        self.route("GET", r"/api/v1/me", self.me)
        self.server = QuietServer(("127.0.0.1", port), self.handler_class())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def route(self, method: str, pattern: str, handler: Callable) -> None:
        self.routes[(method, pattern)] = handler

    def got(self, method: str | None = None, path: str = "") -> list[Request]:
        with self.lock:
            return [r for r in self.requests if (method is None or r.method == method) and r.path.startswith(path)]

    def authorized(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {KEY}"

    def serve_schema(self, request: Request, match) -> Answer:
        if request.headers.get("if-none-match") == self.etag:
            return Answer(304, None, {"ETag": self.etag})
        return Answer(200, self.schema, {"ETag": self.etag})

    def me(self, request: Request, match) -> Answer:
        if not self.authorized(request):
            return error(401, "authentication_failed", "Invalid, expired or revoked API key.")
        return Answer(200, {"kind": "tenant_key", "username": "alice", "tenant": "acme", "role": "admin"})

    def handler_class(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def handle_any(self):
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                request = Request(
                    self.command,
                    parts.path,
                    {k: v[-1] for k, v in parse_qs(parts.query).items()},
                    {k.lower(): v for k, v in self.headers.items()},
                    json.loads(raw) if raw else None,
                )
                with api.lock:
                    api.requests.append(request)
                for (method, pattern), handler in list(api.routes.items()):
                    match = re.fullmatch(pattern, parts.path)
                    if method == self.command and match:
                        if getattr(handler, "streams", False):
                            handler(request, match, self)
                            return
                        answer = handler(request, match)
                        break
                else:
                    answer = error(404, "not_found", "Not found.")
                self.send(answer)

            def send(self, answer: Answer):
                body = b"" if answer.body is None else json.dumps(answer.body).encode()
                self.send_response(answer.status)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                if answer.body is not None:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = handle_any

        return Handler


def streaming(handler: Callable) -> Callable:
    """Mark a route handler that writes its own response (server-sent events)."""

    def stream(request, match, http):
        return handler(request, match, http)

    stream.streams = True
    return stream


def start_events(http: BaseHTTPRequestHandler) -> None:
    """The head of a text/event-stream answer, chunked (HTTP/1.1)."""
    http.send_response(200)
    http.send_header("Content-Type", "text/event-stream")
    http.send_header("Cache-Control", "no-cache")
    http.send_header("Transfer-Encoding", "chunked")
    http.end_headers()


def send_chunk(http: BaseHTTPRequestHandler, text: str) -> None:
    data = text.encode()
    http.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    http.wfile.flush()


def end_chunks(http: BaseHTTPRequestHandler) -> None:
    http.wfile.write(b"0\r\n\r\n")
    http.wfile.flush()


def lines_event(lines: list[dict], event: str = "lines") -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}id: {lines[-1]['seq']}\ndata: {json.dumps({'lines': lines})}\n\n"


def line(seq: int, text: str | None = None, **extra) -> dict:
    return {"seq": seq, "at": "2026-12-01T10:00:00Z", "stream": "stdout", "text": text or f"line {seq}", **extra}
