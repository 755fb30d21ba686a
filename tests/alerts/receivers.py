"""Real receivers for notification tests: an HTTP server and a small SMTP server, each in
a thread on 127.0.0.1, answering as scripted. Plus the signature check a receiver runs,
written from docs/alerts.md (not imported from the server)."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import queue
import socketserver
import threading
import time
from dataclasses import dataclass, field


def verify_signature(secret: str, timestamp: str, body: bytes, signature: str, tolerance: int = 300) -> bool:
    """The receiver's check, as docs/alerts.md shows it."""
    if abs(time.time() - int(timestamp)) > tolerance:
        return False
    expected = "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, signature)


@dataclass
class Received:
    path: str
    headers: dict
    body: bytes

    @property
    def json(self) -> dict:
        return json.loads(self.body)

    def verifies_with(self, secret: str, body: bytes | None = None) -> bool:
        return verify_signature(
            secret,
            self.headers["X-HeteroFlow-Timestamp"],
            self.body if body is None else body,
            self.headers["X-HeteroFlow-Signature"],
        )


HANG = "hang"  # a scripted answer: hold the request until the test ends


@dataclass
class HttpReceiver:
    """Answers each POST with the next scripted answer: a status code, (status,
    headers), or HANG; 200 once the script is used up."""

    server: http.server.ThreadingHTTPServer = None
    received: list = field(default_factory=list)
    script: queue.Queue = field(default_factory=queue.Queue)
    release: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/hooks/heteroflow?token=t0k3n-in-the-url"

    def answer(self, *answers) -> None:
        for item in answers:
            self.script.put(item)


def start_http_receiver() -> HttpReceiver:
    receiver = HttpReceiver()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            receiver.received.append(Received(self.path, dict(self.headers.items()), body))
            try:
                answer = receiver.script.get_nowait()
            except queue.Empty:
                answer = 200
            if answer == HANG:
                receiver.release.wait(30)
                answer = 200
            status, headers = answer if isinstance(answer, tuple) else (answer, {})
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    receiver.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.server.daemon_threads = True
    threading.Thread(target=receiver.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return receiver


def stop_http_receiver(receiver: HttpReceiver) -> None:
    receiver.release.set()
    receiver.server.shutdown()
    receiver.server.server_close()


@dataclass
class SmtpServer:
    """Just enough SMTP for smtplib: RCPT TO is answered with `rcpt_reply`."""

    server: socketserver.ThreadingTCPServer = None
    rcpt_reply: str = "250 OK"
    messages: list = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.server.server_address[1]


def start_smtp_server(rcpt_reply: str = "250 OK") -> SmtpServer:
    smtp = SmtpServer(rcpt_reply=rcpt_reply)

    class Handler(socketserver.StreamRequestHandler):
        def reply(self, line: str):
            self.wfile.write(line.encode() + b"\r\n")

        def handle(self):
            self.reply("220 test ESMTP")
            while line := self.rfile.readline():
                verb = line.decode(errors="replace").strip().split(" ")[0].upper()
                if verb in ("EHLO", "HELO"):
                    self.reply("250 test")
                elif verb in ("MAIL", "RSET", "NOOP"):
                    self.reply("250 OK")
                elif verb == "RCPT":
                    self.reply(smtp.rcpt_reply)
                elif verb == "DATA":
                    self.reply("354 go ahead")
                    data = b""
                    while not data.endswith(b"\r\n.\r\n"):
                        chunk = self.rfile.readline()
                        if not chunk:
                            return
                        data += chunk
                    smtp.messages.append(data)
                    self.reply("250 queued")
                elif verb == "QUIT":
                    self.reply("221 bye")
                    return
                else:
                    self.reply("502 not implemented")

    smtp.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    smtp.server.daemon_threads = True
    threading.Thread(target=smtp.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return smtp


def stop_smtp_server(smtp: SmtpServer) -> None:
    smtp.server.shutdown()
    smtp.server.server_close()
