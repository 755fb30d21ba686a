"""`hf exec`, `hf ssh` and `hf port-forward` against a stand-in of the API's tunnel
WebSockets (a real websockets server on 127.0.0.1, in a thread), speaking the protocol
docs/tunnel.md describes: the frames of an exec (stdin in, stdout and stderr out, the
exit status), a port's bytes both ways, and refusals answered as HTTP before the
WebSocket opens. The real path (control plane, tunnel, agent) is
tests/tunnel/test_tunnel_e2e.py."""

from __future__ import annotations

import asyncio
import json
import threading
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import pytest
from hf_fakeapi import KEY
from websockets.asyncio.server import serve
from websockets.datastructures import Headers
from websockets.http11 import Response

from heteroflow_client import tunnel

STDIN, STDOUT, STDERR, RESIZE, EOF, EXIT = 0, 1, 2, 3, 4, 5


class StandIn:
    """Task 7 runs `tr a-z A-Z` and exits 3; task 8 is not running (409); task 9's port
    80 echoes; any other key is 401. `seen` records each session's path and query."""

    def __init__(self):
        self.seen: list[tuple[str, dict]] = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def main():
            self.server = await serve(self.session, "127.0.0.1", 0, process_request=self.check)
            self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
            started.set()
            await self.server.serve_forever()

        self.thread = threading.Thread(target=lambda: self.loop.run_until_complete(main()), daemon=True)
        self.thread.start()
        started.wait(10)

    def check(self, connection, request):
        path = urlsplit(request.path)
        self.seen.append((path.path, parse_qs(path.query)))
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return refusal(401, "authentication_failed", "Invalid, expired or revoked API key.")
        if path.path.startswith("/api/v1/tasks/8/"):
            return refusal(409, "task_not_running", "Task 8 is stopped, not running.")
        return None

    async def session(self, ws):
        path = urlsplit(ws.request.path).path
        if path == "/api/v1/tasks/9/tunnel":
            async for message in ws:
                if isinstance(message, bytes):
                    await ws.send(message)
                elif json.loads(message).get("eof"):
                    break
            return
        async for message in ws:
            kind, payload = message[0], message[1:]
            if kind == STDIN:
                await ws.send(bytes([STDOUT]) + payload.upper())
            elif kind == EOF:
                await ws.send(bytes([STDERR]) + b"bye\n")
                await ws.send(bytes([EXIT]) + json.dumps({"status": 3}).encode())
                return

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.thread.join(5)


def refusal(status: int, code: str, message: str) -> Response:
    body = json.dumps({"error": {"code": code, "message": message, "fields": {}}}).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return Response(status, HTTPStatus(status).phrase, headers, body)


@pytest.fixture
def standin(monkeypatch, home):
    server = StandIn()
    monkeypatch.setenv("HETEROFLOW_URL", server.url)
    monkeypatch.setenv("HETEROFLOW_API_KEY", KEY)
    yield server
    server.close()


@pytest.fixture
def hf_cli(standin):
    from click.testing import CliRunner

    from heteroflow_client.cli import cli

    def run(*args, input=None):
        result = CliRunner().invoke(cli, list(args), input=input, prog_name="hf", catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    return run


def test_exec_sends_stdin_prints_both_streams_and_exits_with_the_commands_status(hf_cli, standin):
    code, out, err = hf_cli("exec", "7", "--", "tr", "a-z", "A-Z", input="hello\n")
    assert (code, out, err) == (3, "HELLO\n", "bye\n")
    path, query = standin.seen[-1]
    assert path == "/api/v1/tasks/7/exec" and query == {"argv": ["tr", "a-z", "A-Z"]}  # no "--", no terminal


def test_exec_with_a_terminal_and_a_rank_asks_for_them(standin):
    status = asyncio.run(
        tunnel.run_exec(standin.url, KEY, 7, [], rank=2, tty=True, stdin=_Empty(), stdout=_Sink(), stderr=_Sink())
    )
    assert status == 3
    _, query = standin.seen[-1]
    assert query["tty"] == ["1"] and query["rank"] == ["2"] and query["cols"] == ["80"] and query["rows"] == ["24"]
    assert "argv" not in query  # hf ssh: the node's shell


def test_refusals_are_the_apis_errors(hf_cli, standin, monkeypatch):
    code, out, err = hf_cli("exec", "8", "--", "true")
    assert code == 1 and "Task 8 is stopped, not running. (409 task_not_running)" in err
    code, out, err = hf_cli("port-forward", "8", "0:80")
    assert code == 1 and "409 task_not_running" in err
    monkeypatch.setenv("HETEROFLOW_API_KEY", "sk-tenant-wrong")
    code, out, err = hf_cli("ssh", "7")
    assert code == 2 and "hf login" in err


def test_port_forward_carries_a_connections_bytes_both_ways(standin):
    async def go():
        ready = asyncio.get_running_loop().create_future()
        forward = asyncio.ensure_future(
            tunnel.serve_port_forward(standin.url, KEY, 9, 0, 80, on_ready=ready.set_result)
        )
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", await asyncio.wait_for(ready, 10))
            writer.write(b"x" * 300_000)
            await writer.drain()
            echoed = await asyncio.wait_for(reader.readexactly(300_000), 10)
            writer.write_eof()
            rest = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return echoed, rest
        finally:
            forward.cancel()
            await asyncio.gather(forward, return_exceptions=True)

    echoed, rest = asyncio.run(go())
    assert echoed == b"x" * 300_000 and rest == b""
    assert all(query == {"port": ["80"]} for path, query in standin.seen if path == "/api/v1/tasks/9/tunnel")


def test_port_forward_takes_local_colon_remote(hf_cli):
    code, out, err = hf_cli("port-forward", "9", "80:eighty")
    assert code == 2 and "LOCAL:REMOTE" in err
    code, out, err = hf_cli("port-forward", "9", "80:70000")
    assert code == 2 and "1-65535" in err


class _Empty:
    def fileno(self):
        raise OSError("not a file")

    def read(self, size=-1):
        return b""


class _Sink:
    def __init__(self):
        self.data = b""

    def write(self, data):
        self.data += data

    def flush(self):
        pass
