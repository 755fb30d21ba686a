"""The tunnel process (`manage.py tunnel`; docs/tunnel.md): the control plane's end of
the agents' outbound tunnels, and the relay that splices users' sessions into them.

- Agents dial HETEROFLOW_TUNNEL_HOST:PORT and serve SSH on that connection (asyncssh
  `connect_reverse`); here `listen_reverse` accepts it and is the SSH client, logging in
  with the control plane's client key (apps.tunnel.keys). Which node it is comes from the
  host key it presents: the key the node pinned through the agent route
  (apps.tunnel.pinning); an unknown key is closed at once.
- The instance holding a node's tunnel says so in Redis (apps.tunnel.registry).
- The relay (RELAY_HOST:RELAY_PORT) takes a web process's connection with a signed
  header (apps.tunnel.keys.sign): a port session is then the raw bytes of a
  `direct-tcpip` channel to `task-ID:PORT`; an exec session is frames (apps.tunnel.frames)
  to and from an SSH exec with a PTY when asked. Every session is audited
  (apps.tunnel.audit), refusals included, and ends after the idle timeout or the maximum
  length.

Nothing here touches the ORM: raw SQL on an async pool, Redis with the asyncio client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from enum import StrEnum

import asyncssh
import orjson
from django.conf import settings

from apps.core.db import LoopPool
from apps.core.error_codes import CoreErrorCode
from apps.core.redis import async_client
from apps.tunnel import audit, frames, keys, registry
from apps.tunnel.choices import SessionKind, SessionOutcome
from apps.tunnel.error_codes import TunnelErrorCode

logger = logging.getLogger(__name__)

USERNAME = "heteroflow"
READ_BYTES = 256 * 1024
HEADER_MAX_BYTES = 64 * 1024
# the agent's first line on an exec's stderr: "heteroflow-exec: ok" or "heteroflow-exec: refused: WHY"
ACK_PREFIX = b"heteroflow-exec: "
KEEPALIVE_SECONDS = 30.0
CLOSE_SECONDS = 5.0  # at a stop, how long the open sessions get to write their audit rows


class Session:
    """One user session's accounting: bytes each way, last activity, how it ended."""

    def __init__(self, idle: float, longest: float):
        self.bytes_in = self.bytes_out = 0
        self.started = self.last = time.monotonic()
        self.idle, self.longest = idle, longest
        self.outcome, self.reason = SessionOutcome.CLOSED, ""
        self.refusal: tuple[StrEnum, str] | None = None  # (code, message): answered once audited

    def refuse(self, code: StrEnum, reason: str) -> None:
        self.outcome, self.reason, self.refusal = SessionOutcome.REFUSED, reason, (code, reason)

    def moved(self, inbound: int = 0, outbound: int = 0) -> None:
        self.bytes_in += inbound
        self.bytes_out += outbound
        self.last = time.monotonic()

    async def watch(self) -> None:
        """Returns when the session must end (idle or too long), setting the outcome."""
        while True:
            now = time.monotonic()
            if now - self.last >= self.idle:
                self.outcome, self.reason = SessionOutcome.IDLE, f"no traffic for {self.idle:g} s"
                return
            if now - self.started >= self.longest:
                self.outcome, self.reason = SessionOutcome.MAX_LENGTH, f"open for {self.longest:g} s"
                return
            await asyncio.sleep(min(1.0, self.idle / 5))


class TunnelServer:
    def __init__(
        self,
        host: str | None = None,
        port: int | None = None,
        relay_host: str | None = None,
        relay_port: int | None = None,
        advertise: str | None = None,
    ):
        self.host = settings.HETEROFLOW_TUNNEL_HOST if host is None else host
        self.port = settings.HETEROFLOW_TUNNEL_PORT if port is None else port
        self.relay_host = settings.HETEROFLOW_TUNNEL_RELAY_HOST if relay_host is None else relay_host
        self.relay_port = settings.HETEROFLOW_TUNNEL_RELAY_PORT if relay_port is None else relay_port
        self._advertise = advertise if advertise is not None else settings.HETEROFLOW_TUNNEL_RELAY_ADVERTISE
        self.nodes: dict[str, asyncssh.SSHClientConnection] = {}
        self._pool = LoopPool(lambda: settings.HETEROFLOW_TUNNEL_DB_POOL_SIZE)
        self.acceptor = self.relay = None
        self._tasks: set[asyncio.Task] = set()
        self._sessions: set[asyncio.Task] = set()  # the relay's sessions, waited for at close
        self.address = ""  # the relay's address as the other instances reach it

    # --- life ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.pool = await self._pool.get()
        self.redis = async_client()
        self.relay = await asyncio.start_server(self.relay_session, self.relay_host, self.relay_port, limit=1 << 20)
        relay_port = self.relay.sockets[0].getsockname()[1]
        self.address = self._advertise or f"{self.relay_host}:{relay_port}"
        self.acceptor = await asyncssh.listen_reverse(
            self.host,
            self.port,
            client_keys=[keys.client_key()],
            known_hosts=None,  # the node is named by its pinned key, checked in `accepted`
            username=USERNAME,
            acceptor=self.accepted,
            keepalive_interval=KEEPALIVE_SECONDS,
            login_timeout=15,
            reuse_address=True,
        )
        self.port = self.acceptor.get_port()
        self._spawn(self.refresh())
        logger.info("tunnel: agents on %s:%s, relay on %s", self.host, self.port, self.address)

    async def close(self) -> None:
        """Stop taking connections, close the tunnels (their sessions end `lost`, and are
        audited so), then let go of the pool."""
        if self.acceptor is not None:
            self.acceptor.close()
        if self.relay is not None:
            self.relay.close()
        for node_id, conn in list(self.nodes.items()):
            conn.close()
            with contextlib.suppress(Exception):
                await registry.forget(self.redis, node_id, self.address)
        if self._sessions:
            await asyncio.wait(set(self._sessions), timeout=CLOSE_SECONDS)
        for task in list(self._tasks | self._sessions):
            task.cancel()
        await self._pool.close()

    async def serve_forever(self) -> None:
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        await self.close()

    def _spawn(self, coroutine) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def refresh(self) -> None:
        while True:
            await asyncio.sleep(registry.REFRESH_SECONDS)
            try:
                await registry.refresh(self.redis, list(self.nodes), self.address)
            except Exception as error:  # noqa: BLE001  (Redis away: the next refresh writes them)
                logger.warning("tunnel: cannot refresh %d nodes in Redis: %s", len(self.nodes), error)

    # --- the agents ---------------------------------------------------------------------

    async def accepted(self, conn: asyncssh.SSHClientConnection) -> None:
        key = conn.get_server_host_key()
        print_ = key.get_fingerprint("sha256") if key is not None else ""
        node_id = await audit.node_of_key(self.pool, print_) if print_ else None
        peer = conn.get_extra_info("peername")
        if node_id is None:
            logger.warning("tunnel: a connection from %s with an unpinned host key %s: closed", peer, print_)
            conn.close()
            return
        old = self.nodes.get(node_id)
        self.nodes[node_id] = conn
        if old is not None and old is not conn:
            old.close()  # the node dialled again: its old connection is dead or dying
        logger.info("tunnel: node %s connected from %s", node_id, peer)
        try:
            await registry.hold(self.redis, node_id, self.address)
        except Exception as error:  # noqa: BLE001
            logger.warning("tunnel: node %s not recorded in Redis yet (%s); the next refresh does", node_id, error)
        await audit.node_connected(self.pool, node_id, self.address)
        self._spawn(self._watch(node_id, conn))

    async def _watch(self, node_id: str, conn) -> None:
        await conn.wait_closed()
        if self.nodes.get(node_id) is conn:
            del self.nodes[node_id]
            logger.info("tunnel: node %s disconnected", node_id)
            with contextlib.suppress(Exception):
                await registry.forget(self.redis, node_id, self.address)

    # --- the relay ----------------------------------------------------------------------

    async def relay_session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        current = asyncio.current_task()
        self._sessions.add(current)
        try:
            await self._relay_session(reader, writer)
        finally:
            self._sessions.discard(current)

    async def _relay_session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
        except (TimeoutError, ValueError, ConnectionError):
            writer.close()
            return
        if not line.strip():  # a probe that connects and goes (a health check)
            writer.close()
            return
        header = keys.verify(line)
        if header is None:
            logger.warning("tunnel: a relay request with a bad signature from %s", writer.get_extra_info("peername"))
            await self._answer(
                writer, False, CoreErrorCode.BAD_REQUEST, "The request is not signed by this control plane."
            )
            writer.close()
            return
        try:
            await self.serve(header, reader, writer)
        except Exception:
            logger.exception("tunnel: session %s failed", header)
        finally:
            writer.close()

    async def _answer(self, writer, ok: bool, code: StrEnum | None = None, message: str = "") -> None:
        writer.write(orjson.dumps({"ok": ok, "code": code and str(code), "message": message}) + b"\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async def serve(self, header: dict, reader, writer) -> None:
        node_id, kind = str(header.get("node") or ""), header.get("kind")
        conn = self.nodes.get(node_id)
        if conn is None:
            await audit.start(self.pool, header, self.address, SessionOutcome.UNREACHABLE, "no tunnel on this instance")
            await self._answer(
                writer, False, TunnelErrorCode.NODE_UNREACHABLE, f"Node {node_id} has no tunnel to this instance."
            )
            return
        session_id = await audit.start(self.pool, header, self.address)
        session = Session(settings.HETEROFLOW_TUNNEL_IDLE_SECONDS, settings.HETEROFLOW_TUNNEL_MAX_SECONDS)
        try:
            if kind == SessionKind.PORT:
                await self._port(conn, header, session, reader, writer)
            elif kind == SessionKind.EXEC:
                await self._exec(conn, header, session, reader, writer)
            else:
                session.refuse(CoreErrorCode.BAD_REQUEST, f"unknown kind {kind!r}")
        except (asyncssh.Error, ConnectionError, OSError) as error:
            if conn.is_closed():
                session.outcome, session.reason = SessionOutcome.LOST, "the node's tunnel closed"
            else:
                session.reason = f"{type(error).__name__}: {error}"
        finally:
            await audit.end(self.pool, session_id, session.bytes_in, session.bytes_out, session.outcome, session.reason)
            if session.refusal is not None:  # after its audit row: whoever was refused finds it written
                await self._answer(writer, False, *session.refusal)

    async def _port(self, conn, header: dict, session: Session, reader, writer) -> None:
        try:
            channel_reader, channel_writer = await conn.open_connection(
                f"task-{int(header['task'])}", int(header["port"])
            )
        except asyncssh.ChannelOpenError as refused:
            session.refuse(TunnelErrorCode.REFUSED_BY_NODE, refused.reason)
            return
        await self._answer(writer, True)

        async def user_to_task() -> None:
            while data := await reader.read(READ_BYTES):
                session.moved(inbound=len(data))
                channel_writer.write(data)
                await channel_writer.drain()
            channel_writer.write_eof()

        async def task_to_user() -> None:
            while data := await channel_reader.read(READ_BYTES):
                session.moved(outbound=len(data))
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.write_eof()

        await self._until_done(session, [user_to_task(), task_to_user()], all_of=True)
        channel_writer.close()

    async def _exec(self, conn, header: dict, session: Session, reader, writer) -> None:
        tty = header.get("tty") or None
        command = orjson.dumps({"task": int(header["task"]), "argv": list(header.get("argv") or [])}).decode()
        options = {}
        if tty:
            options = {
                "term_type": str(tty.get("term") or "xterm"),
                "term_size": (int(tty.get("cols") or 80), int(tty.get("rows") or 24)),
            }
        process = await conn.create_process(command, encoding=None, **options)
        try:  # the agent's first line on stderr says whether it runs the command (ACK_PREFIX)
            ack = await asyncio.wait_for(process.stderr.readline(), 30)
        except TimeoutError:
            ack = b""
        if not ack.startswith(ACK_PREFIX + b"ok"):
            reason = ack[len(ACK_PREFIX) :].decode(errors="replace").strip() or "the node did not answer"
            reason = reason.removeprefix("refused: ")
            session.refuse(TunnelErrorCode.REFUSED_BY_NODE, reason)
            process.close()
            return
        await self._answer(writer, True)

        async def user_to_task() -> None:
            while (frame := await frames.read(reader)) is not None:
                kind, payload = frame
                if kind == frames.STDIN:
                    session.moved(inbound=len(payload))
                    process.stdin.write(payload)
                    await process.stdin.drain()
                elif kind == frames.RESIZE:
                    cols, rows = orjson.loads(payload)
                    process.change_terminal_size(int(cols), int(rows))
                elif kind == frames.EOF:
                    process.stdin.write_eof()
            process.close()  # the user went away: the command ends with the session

        async def copy(stream, kind: int) -> None:
            while data := await stream.read(READ_BYTES):
                session.moved(outbound=len(data))
                writer.write(frames.pack(kind, data))
                await writer.drain()

        async def task_to_user() -> None:
            await asyncio.gather(copy(process.stdout, frames.STDOUT), copy(process.stderr, frames.STDERR))
            completed = await process.wait(check=False)
            status = completed.exit_status if completed.exit_status is not None else 255
            if completed.exit_signal:
                status = 128 + (getattr(signal, f"SIG{completed.exit_signal[0]}", 0) or 0)
            writer.write(frames.pack(frames.EXIT, orjson.dumps({"status": status})))
            await writer.drain()

        await self._until_done(session, [user_to_task(), task_to_user()], all_of=False, last=1)
        process.close()
        if session.outcome in (SessionOutcome.IDLE, SessionOutcome.MAX_LENGTH):  # say why, then the end
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(frames.pack(frames.STDERR, f"\r\nhf: session ended: {session.reason}\r\n".encode()))
                writer.write(frames.pack(frames.EXIT, orjson.dumps({"status": 255})))
                await writer.drain()

    async def _until_done(self, session: Session, pumps: list, *, all_of: bool, last: int | None = None) -> None:
        """Run the pumps until they are done (all, or the one at `last`), the session goes
        idle or runs too long."""
        tasks = [asyncio.ensure_future(pump) for pump in pumps]
        watcher = asyncio.ensure_future(session.watch())
        try:
            if all_of:
                finished = asyncio.ensure_future(asyncio.gather(*tasks))
            else:
                finished = tasks[last]
            done, _ = await asyncio.wait({finished, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if finished in done:
                finished.result()
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, watcher, return_exceptions=True)


def run() -> None:
    """`manage.py tunnel`: serve until SIGTERM."""
    try:
        import uvloop  # noqa: PLC0415

        uvloop.install()
    except ImportError:
        logger.debug("uvloop is not installed: the standard event loop")
    asyncssh.set_log_level(logging.WARNING)  # not a line for each channel opened
    asyncio.run(TunnelServer().serve_forever())
