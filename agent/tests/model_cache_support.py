"""What the model cache's tests share: a model mirror on a real socket (Python's
http.server serving a generated file set with its manifest), the reports recorder, and
the shapes of a hub model and its serving."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Mirror:
    """A model mirror on a real socket: `files[model][path] = bytes`, the manifest made
    from them (sha256 included unless `without_checksums`). Range requests are answered
    206; `cut[path] = n` makes the next answer for that file stop after n bytes and
    close the connection (once). Every request's path and Range header are recorded."""

    def __init__(self):
        self.files: dict[str, dict[str, bytes]] = {}
        self.cut: dict[str, int] = {}
        self.hold: dict[str, tuple[int, threading.Event]] = {}  # path -> (after n bytes, wait for)
        self.lies: dict[str, str] = {}  # path -> a wrong sha256 for the manifest
        self.without_checksums = False
        self.requests: list[tuple[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.requests.append((self.path, self.headers.get("Range", "")))
                if self.path.startswith("/api/models/") and self.path.endswith("/revision/main?blobs=true"):
                    return self._huggingface_listing(self.path[len("/api/models/") : -len("/revision/main?blobs=true")])
                if "/resolve/main/" in self.path:
                    model, _, name = self.path.strip("/").partition("/resolve/main/")
                    if name in owner.files.get(model, {}):
                        return self._file(name, owner.files[model][name])
                    return self._send(404, b"not here")
                model, _, name = self.path.strip("/").rpartition("/")
                files = owner.files.get(model)
                if files is not None and name == "manifest.json":
                    listing = [
                        {"path": p, "size": len(data)}
                        | ({} if owner.without_checksums else {"sha256": owner.lies.get(p) or sha(data)})
                        for p, data in files.items()
                    ]
                    return self._send(200, json.dumps({"files": listing}).encode())
                for model_name, model_files in owner.files.items():
                    prefix = f"/{model_name}/"
                    if self.path.startswith(prefix) and self.path[len(prefix) :] in model_files:
                        return self._file(self.path[len(prefix) :], model_files[self.path[len(prefix) :]])
                self._send(404, b"not here")

            def _huggingface_listing(self, model):
                """As the Hub answers: large files (.gguf here) are LFS, with a sha256; the
                others only a git blob id."""
                if model not in owner.files:
                    return self._send(404, b'{"error": "Repository not found"}')
                siblings = []
                for p, data in owner.files[model].items():
                    sibling = {"rfilename": p, "size": len(data), "blobId": "0" * 40}
                    if p.endswith(".gguf"):
                        sibling["lfs"] = {"sha256": owner.lies.get(p) or sha(data), "size": len(data)}
                    siblings.append(sibling)
                self._send(200, json.dumps({"id": model, "siblings": siblings}).encode())

            def _file(self, path, data):
                start = 0
                if self.headers.get("Range", "").startswith("bytes="):
                    start = int(self.headers["Range"][6:].rstrip("-"))
                body = data[start:]
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                held = owner.hold.pop(path, None)
                if held is not None:  # a slow mirror: part of it, then the rest when released
                    self.wfile.write(body[: held[0]])
                    self.wfile.flush()
                    held[1].wait(30)
                    body = body[held[0] :]
                cut = owner.cut.pop(path, None)
                if cut is not None:
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def _send(self, status, body):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def file_requests(self, path: str) -> list[str]:
        return [rng for requested, rng in self.requests if requested.endswith("/" + path)]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Reports:
    def __init__(self):
        self.sent: list[tuple[int, str, dict]] = []

    def __call__(self, task_id, state, fields):
        self.sent.append((task_id, state, fields))

    def states(self):
        return [state for _, state, _ in self.sent]


def gguf_model(size: int = 300_000) -> dict[str, bytes]:
    body = os.urandom(size)
    return {"tiny.gguf": b"GGUF" + body, "README.md": b"a tiny model\n"}


def hub(model: str, format: str = "gguf") -> dict:
    return {"engine": "llama.cpp", "model": model, "format": format, "source_kind": "hub", "source": model}
