"""A scripted control plane on a real socket: each request takes the next scripted answer
(status, body, headers) for its path, and every request is recorded. While `stalled` is
set, a request is read and recorded but never answered: the connection stays open until
the client gives up or the server closes (a control plane that hangs)."""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedServer:
    def __init__(self):
        self.script: dict[str, list[tuple[int, dict, dict]]] = {}
        self.default: tuple[int, dict, dict] = (404, {"error": {"code": "not_found"}}, {})
        self.requests: list[dict] = []
        self.stalled = threading.Event()
        self.closing = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                path = self.path.split("?")[0]
                owner.requests.append(
                    {
                        "method": self.command,
                        "path": self.path,
                        "headers": dict(self.headers),
                        "json": json.loads(body) if body else None,
                    }
                )
                if owner.stalled.is_set():
                    owner.closing.wait()  # no answer, and no scripted answer used up
                    return
                queue = owner.script.get(path)
                status, payload, headers = queue.pop(0) if queue else owner.default
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _answer

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, path: str, *answers: tuple):
        self.script.setdefault(path, []).extend((a + ({},))[:3] if len(a) == 2 else a for a in answers)

    def close(self):
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()
