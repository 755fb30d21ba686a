"""A metrics listener of its own, on its own port: METRICS_LISTEN_ADDR for the web
process (with the cluster snapshot and a readiness probe), HETEROFLOW_WORKER_METRICS_ADDR
and HETEROFLOW_BEAT_METRICS_ADDR for the Celery processes.

It lives outside Django's request stack, so it keeps answering when the application
port is saturated, and it can be bound to an interface the application port is not on.

    /metrics  the exposition; the same peer allow-list as the application's /metrics
    /healthz  200 while the process runs
    /readyz   200 when the database answers, 503 with the reason when it does not
              (web only; the Celery exporters answer /healthz alone)
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from django.db import connections

from apps.core.error_codes import CoreErrorCode
from apps.monitoring import access, exposition, probes
from apps.monitoring.error_codes import MonitoringErrorCode

logger = logging.getLogger(__name__)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _server_for(host: str, port: int, handler) -> _Server:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(_Server):
        address_family = family

    return Server((host, port), handler)


class MetricsListener:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        source: exposition.Exposition,
        readiness: Callable[[], tuple[bool, str]] | None = None,
        name: str = "metrics",
    ):
        self.host, self.port, self.source, self.readiness, self.name = host, port, source, readiness, name
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2] if self._server else (self.host, self.port)

    def start(self) -> MetricsListener:
        self._server = _server_for(self.host, self.port, self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"{self.name}-listener", daemon=True)
        self._thread.start()
        logger.info("%s listener on %s:%s", self.name, *self.address)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _handler(self):
        listener = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "heteroflow-metrics"

            def do_GET(self):
                try:
                    path = self.path.split("?", 1)[0]
                    if path == "/metrics":
                        self.metrics()
                    elif path == "/healthz":
                        self.answer(200, {"status": "ok"})
                    elif path == "/readyz" and listener.readiness is not None:
                        ready, reason = listener.readiness()
                        self.answer(
                            200 if ready else 503, {"status": "ready" if ready else "unready", "reason": reason}
                        )
                    else:
                        self.answer(
                            404, {"error": {"code": CoreErrorCode.NOT_FOUND, "message": "Not found.", "fields": {}}}
                        )
                finally:
                    # each request has a thread of its own: give its connection back
                    connections.close_all()

            def metrics(self):
                if not access.peer_may_scrape(self.client_address[0]):
                    self.answer(
                        403,
                        {
                            "error": {
                                "code": MonitoringErrorCode.FORBIDDEN,
                                "fields": {},
                                "message": "Metrics are served to private and loopback addresses only.",
                            }
                        },
                    )
                    return
                body, content_type = exposition.render(listener.source, self.headers.get("Accept", ""))
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def answer(self, status: int, document: dict):
                body = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args):  # scrapes every 15 s would flood the log
                pass

        return Handler


def database_readiness() -> tuple[bool, str]:
    if probes.database_answers():
        return True, "database answers"
    return False, "database unreachable"


def start(address: tuple[str, int] | None, *, source, readiness=None, name: str) -> MetricsListener | None:
    """Start a listener when an address is configured. Several processes of one group
    (uvicorn workers) all try; the first binds and the others, whose files it sums up
    anyway, leave it at that."""
    if address is None:
        return None
    try:
        return MetricsListener(*address, source=source, readiness=readiness, name=name).start()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            logger.info("%s listener: %s:%s is taken (another process of this group serves it)", name, *address)
            return None
        raise


def start_for_web() -> MetricsListener | None:
    from django.conf import settings

    return start(settings.METRICS_LISTEN_ADDR, source=exposition.WEB, readiness=database_readiness, name="web metrics")
