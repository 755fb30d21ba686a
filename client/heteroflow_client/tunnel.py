"""The way into a running task, through the control plane's tunnel (docs/tunnel.md):
`port_forward` (a local port to a port of the task) and `exec` (a command in the task,
with a terminal when asked). Both are WebSockets on the API's own port:

- `/api/v1/tasks/{id}/tunnel?port=N`: the bytes of one TCP connection, as binary
  messages both ways; `{"eof": true}` (a text message) when the local side has no more
  to send.
- `/api/v1/tasks/{id}/exec?argv=…&tty=1&term=…&cols=…&rows=…`: frames, one a message,
  a type byte then the payload: 0 stdin, 1 stdout, 2 stderr, 3 resize (JSON [cols,
  rows]), 4 end of stdin, 5 exit (JSON {"status": N}).

A refusal is an HTTP answer before the WebSocket opens (404 not yours, 403 a viewer,
409 not running...), raised as the SDK's ApiError."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from urllib.parse import urlencode, urlsplit, urlunsplit

from heteroflow_client.errors import ApiError, AuthError, ConnectionFailed, NotFound

STDIN, STDOUT, STDERR, RESIZE, EOF, EXIT = 0, 1, 2, 3, 4, 5
READ_BYTES = 256 * 1024


def _ws_url(base: str, path: str, query: dict | list) -> str:
    parts = urlsplit(base)
    scheme = "wss" if parts.scheme == "https" else "ws"
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + path, urlencode(query, doseq=True), ""))


async def _connect(base: str, key: str, path: str, query):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    url = _ws_url(base, path, query)
    try:
        return await connect(
            url, additional_headers={"Authorization": f"Bearer {key}"}, max_size=None, compression=None, open_timeout=40
        )
    except InvalidStatus as refused:
        raise _api_error(refused.response.status_code, refused.response.body, path) from None
    except OSError as error:
        raise ConnectionFailed(base, str(error)) from None


def _api_error(status: int, body: bytes | None, path: str) -> Exception:
    try:
        error = json.loads(body or b"{}").get("error", {})
    except ValueError:
        error = {}
    message, code = error.get("message") or f"HTTP {status}", error.get("code") or "error"
    if status == 401:
        return AuthError(f"{message} (401 {code}): run `hf login`")
    cls = NotFound if status == 404 else ApiError
    return cls(status, code, message, method="GET", path=path)


# --- port-forward -----------------------------------------------------------------------


async def _forward_one(base: str, key: str, task_id: int, remote: int, rank, reader, writer, on_error) -> None:
    query = {"port": remote, **({"rank": rank} if rank is not None else {})}
    try:
        ws = await _connect(base, key, f"/api/v1/tasks/{task_id}/tunnel", query)
    except Exception as error:  # noqa: BLE001  (one connection's failure is reported, the others go on)
        on_error(error)
        writer.close()
        return

    async def local_to_task() -> None:
        while data := await reader.read(READ_BYTES):
            await ws.send(data)
        await ws.send(json.dumps({"eof": True}))

    async def task_to_local() -> None:
        async for message in ws:
            if isinstance(message, bytes):
                writer.write(message)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    up, down = asyncio.ensure_future(local_to_task()), asyncio.ensure_future(task_to_local())
    try:
        await down  # the task's side decides when the connection is over
    except Exception as error:  # noqa: BLE001
        on_error(error)
    finally:
        up.cancel()
        await asyncio.gather(up, return_exceptions=True)
        await ws.close()
        writer.close()


async def serve_port_forward(
    base: str,
    key: str,
    task_id: int,
    local: int,
    remote: int,
    *,
    rank: int | None = None,
    bind: str = "127.0.0.1",
    on_ready: Callable[[int], None] | None = None,
    on_error: Callable[[Exception], None] | None = None,
    check_first: bool = True,
) -> None:
    """Listen on bind:local (0: any free port; `on_ready(port)` says which), and carry each
    connection to the task's `remote` port, until cancelled. `check_first`: open one
    session before listening, so that a refusal (404, 403, 409, a port the task does not
    listen on) is raised at once rather than on the first connection."""
    if check_first:
        ws = await _connect(
            base, key, f"/api/v1/tasks/{task_id}/tunnel", {"port": remote, **({"rank": rank} if rank else {})}
        )
        await ws.close()
    report = on_error or (lambda error: print(f"hf: port-forward: {error}", file=sys.stderr))
    server = await asyncio.start_server(
        lambda r, w: _forward_one(base, key, task_id, remote, rank, r, w, report), bind, local
    )
    if on_ready is not None:
        on_ready(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


def port_forward(
    client, task, local: int, remote: int, *, rank: int | None = None, bind: str = "127.0.0.1", on_ready=None
):
    """Forward bind:local to the task's port `remote` until interrupted (Ctrl-C)."""
    from heteroflow_client.client import task_id

    asyncio.run(
        serve_port_forward(
            client.url, client.http.key, task_id(task), local, remote, rank=rank, bind=bind, on_ready=on_ready
        )
    )


def wait_for_port(client, task, remote: int, timeout: float, *, on_wait=None, interval: float = 1.0) -> None:
    """Until the task listens on `remote` (the node refuses a port nobody listens on),
    at most `timeout` seconds; `on_wait()` once, when it does not yet. Raises the last
    refusal (ApiError) when it never does."""
    import time

    from heteroflow_client.client import task_id

    deadline = time.monotonic() + timeout
    waited = False

    async def check() -> None:
        ws = await _connect(client.url, client.http.key, f"/api/v1/tasks/{task_id(task)}/tunnel", {"port": remote})
        await ws.close()

    while True:
        try:
            asyncio.run(check())
            return
        except ApiError as refused:
            if refused.code not in ("refused_by_node", "node_unreachable") or time.monotonic() >= deadline:
                raise
        if not waited and on_wait is not None:
            on_wait()
        waited = True
        time.sleep(interval)


# --- exec -------------------------------------------------------------------------------


def _terminal_size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(sys.stdin.fileno())
        return size.columns, size.lines
    except OSError:
        return 80, 24


async def run_exec(
    base: str,
    key: str,
    task_id: int,
    argv: list[str],
    *,
    rank: int | None = None,
    tty: bool = False,
    stdin=None,
    stdout=None,
    stderr=None,
) -> int:
    """Run `argv` in the task (no argv: a shell); stdin's bytes in, the command's stdout
    and stderr out (binary file objects; default the process's own). Returns the
    command's exit status. `tty`: a terminal, stdin put in raw mode when it is one."""
    stdin = stdin if stdin is not None else sys.stdin.buffer
    stdout = stdout if stdout is not None else sys.stdout.buffer
    stderr = stderr if stderr is not None else sys.stderr.buffer
    query: list = [("argv", part) for part in argv]
    if rank is not None:
        query.append(("rank", rank))
    if tty:
        cols, rows = _terminal_size()
        query += [("tty", "1"), ("term", os.environ.get("TERM", "xterm")), ("cols", cols), ("rows", rows)]
    ws = await _connect(base, key, f"/api/v1/tasks/{task_id}/exec", query)
    loop = asyncio.get_running_loop()
    status = 255

    async def feed() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        try:
            fd = stdin.fileno()
        except (OSError, ValueError):  # not a file (a test's BytesIO): read it in a thread
            fd = None

        def readable() -> None:
            try:
                data = os.read(fd, READ_BYTES)
            except OSError:
                data = b""
            queue.put_nowait(data)
            if not data:
                loop.remove_reader(fd)

        try:
            if fd is None:
                raise ValueError("no descriptor")
            loop.add_reader(fd, readable)
        except (PermissionError, ValueError, OSError):  # a regular file, or none: read it in a thread
            while data := await loop.run_in_executor(
                None, stdin.read1 if hasattr(stdin, "read1") else stdin.read, READ_BYTES
            ):
                await ws.send(bytes([STDIN]) + data)
            await ws.send(bytes([EOF]))
            return
        try:
            while data := await queue.get():
                await ws.send(bytes([STDIN]) + data)
            await ws.send(bytes([EOF]))
        finally:
            loop.remove_reader(fd)

    def resized() -> None:
        cols, rows = _terminal_size()
        asyncio.ensure_future(ws.send(bytes([RESIZE]) + json.dumps([cols, rows]).encode()))

    feeder = asyncio.ensure_future(feed())
    if tty:
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            loop.add_signal_handler(signal.SIGWINCH, resized)
    try:
        async for message in ws:
            if not isinstance(message, bytes) or not message:
                continue
            kind, payload = message[0], message[1:]
            if kind in (STDOUT, STDERR):
                sink = stdout if kind == STDOUT else stderr
                sink.write(payload)
                sink.flush()
            elif kind == EXIT:
                status = int(json.loads(payload).get("status", 255))
                break
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        if tty:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.remove_signal_handler(signal.SIGWINCH)
        await ws.close()
    return status


def exec_command(client, task, argv: list[str], *, rank: int | None = None, tty: bool | None = None) -> int:
    """`argv` in the task, attached to this process's stdin, stdout and stderr; a terminal
    (stdin in raw mode) when `tty`, by default when stdin is one. Returns the exit status."""
    from heteroflow_client.client import task_id

    if tty is None:
        tty = sys.stdin.isatty()
    restore = None
    if tty and sys.stdin.isatty():
        import termios
        import tty as tty_mode

        fd = sys.stdin.fileno()
        restore = termios.tcgetattr(fd)
        tty_mode.setraw(fd)
    try:
        return asyncio.run(run_exec(client.url, client.http.key, task_id(task), argv, rank=rank, tty=tty))
    finally:
        if restore is not None:
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, restore)
