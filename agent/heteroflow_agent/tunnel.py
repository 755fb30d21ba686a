"""The agent's end of the tunnel (docs/tunnel.md): an OUTBOUND connection to the control
plane's tunnel process over which the agent serves SSH (asyncssh's reverse connections).

The node still listens on no port. The agent dials the control plane, and on that TCP
connection it is the SSH *server*; the control plane is the SSH client that opens
`direct-tcpip` channels (a port of a task) and exec sessions (a command in a task, with a
PTY when the user has a terminal). SSH brings the framing, multiplexing, flow control
and encryption; this module decides what is allowed:

- Who is on the other end: the control plane's client key, which the agent learns from
  the control plane's API (over HTTPS, with the agent key) when it registers its own host
  key there. Any other client key is refused at authentication.
- Which ports: a channel names its destination `task-ID` and a port. It is admitted only
  for a task this agent runs now (its runtime holds it, running), to that task's address
  alone (its container's IP; a process task's localhost), and for a process task only to
  a port one of the task's processes listens on (a process task shares the host's
  network, so "its port" is what it listens on, not any port of localhost). Anything
  else (an IP address, another task, a port of another task) is refused with the reason,
  which the control plane records in its audit of the session.
- Exec: `{"task": ID, "argv": [...]}` runs in that task's environment: a process task's
  environment, working directory and user (read from its main process), a container
  task's container (`docker exec`). No argv: a login shell.

Host key: ed25519, made on first start and kept in the data directory
(`tunnel-host-key`, 0600); the control plane pins it on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import random
import re
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import asyncssh
import psutil

from heteroflow_agent.runtime.base import TaskReach

logger = logging.getLogger("heteroflow_agent.tunnel")

USERNAME = "heteroflow"  # the only user the control plane logs in as
TASK_HOST = re.compile(r"^task-([1-9][0-9]{0,17})$")
HOST_KEY_FILE = "tunnel-host-key"
REGISTER_PATH = "/api/v1/nodes/{node_id}/tunnel"
RETRY_FIRST, RETRY_CAP = 0.5, 5.0  # seconds between reconnects: doubling, capped, jittered
JITTER = random.SystemRandom()  # a fleet reconnecting together does not dial in step
KEY_REFUSED_RETRY = 60.0  # the control plane pins another key for this node: an operator must act
KEEPALIVE_SECONDS = 30.0  # a dead control plane is noticed within about 3 of these
READ_BYTES = 64 * 1024
SHELLS = ("/bin/bash", "/bin/sh")
# an exec's first line on stderr, read (and not passed on) by the control plane: "ok", or
# "refused: WHY" before the session ends with 126
ACK_PREFIX = b"heteroflow-exec: "


class Refused(Exception):
    """A request the agent does not admit; the message is the reason sent back."""


@dataclass
class Admission:
    """What a channel or an exec may reach. `reach(task_id)` is the runtime's: the
    running task's address (None when it does not run here); `listening(pids)` the ports
    those processes listen on."""

    reach: Callable[[int], TaskReach | None]
    listening: Callable[[frozenset[int]], set[int]] = field(default=lambda pids: listening_ports(pids))

    def task(self, task_id) -> TaskReach:
        if not isinstance(task_id, int) or isinstance(task_id, bool) or task_id <= 0:
            raise Refused("a task id is a positive integer")
        found = self.reach(task_id)
        if found is None:
            raise Refused(f"task {task_id} does not run on this node")
        return found

    def channel(self, dest_host: str, dest_port: int) -> tuple[str, int]:
        """Where to connect for a `direct-tcpip` request to (dest_host, dest_port): the
        task's own address and the port. Raises Refused."""
        matched = TASK_HOST.match(dest_host or "")
        if not matched:
            raise Refused(f"{dest_host!r} is not a task: only task-ID destinations are admitted")
        if not 1 <= dest_port <= 65535:
            raise Refused(f"port {dest_port} is not a TCP port")
        reach = self.task(int(matched[1]))
        if reach.pids is not None and dest_port not in self.listening(reach.pids):
            raise Refused(f"task {reach.task_id} does not listen on port {dest_port}")
        return reach.address, dest_port


def listening_ports(pids: frozenset[int]) -> set[int]:
    """The TCP ports on which any of `pids` listens (on loopback or every address)."""
    ports = set()
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids and conn.laddr:
            address = ipaddress.ip_address(conn.laddr.ip.removeprefix("::ffff:"))
            if address.is_loopback or address.is_unspecified:  # reachable at the task's 127.0.0.1
                ports.add(conn.laddr.port)
    return ports


def host_key(data_dir: Path) -> asyncssh.SSHKey:
    """This node's tunnel host key, made on first start and kept (0600)."""
    path = data_dir / HOST_KEY_FILE
    try:
        return asyncssh.read_private_key(str(path))
    except FileNotFoundError:
        pass
    key = asyncssh.generate_private_key("ssh-ed25519")
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key.export_private_key())
    os.replace(path.with_suffix(".tmp"), path)
    return key


def parse_exec(command: str | None) -> tuple[int, list[str]]:
    """An exec request: {"task": ID, "argv": [...]}. Raises Refused."""
    try:
        request = json.loads(command or "")
    except ValueError:
        raise Refused('an exec request is {"task": ID, "argv": [...]}') from None
    if not isinstance(request, dict):
        raise Refused('an exec request is {"task": ID, "argv": [...]}')
    argv = request.get("argv") or []
    if not isinstance(argv, list) or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise Refused("argv is a list of strings")
    return request.get("task"), argv


# --- the SSH server ---------------------------------------------------------------------


class TunnelServer(asyncssh.SSHServer):
    """One reverse connection's server side: authenticates the control plane's key and
    admits channels (Admission)."""

    def __init__(self, client_key: asyncssh.SSHKey, admission: Admission):
        self.client_key, self.admission = client_key, admission
        self.conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn) -> None:
        self.conn = conn

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        return username == USERNAME and key.public_data == self.client_key.public_data

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int):
        try:
            address, port = self.admission.channel(dest_host, dest_port)
        except Refused as refused:
            logger.warning("tunnel: refused a channel to %s:%s: %s", dest_host, dest_port, refused)
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, str(refused)) from None
        return self.conn.forward_connection(address, port)

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        return False  # no remote forwarding: the control plane never listens on the node


# --- exec -------------------------------------------------------------------------------


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _set_size(fd: int, cols: int, rows: int) -> None:
    if cols > 0 and rows > 0:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_terminal() -> None:  # in the child, after setsid: the PTY becomes its terminal
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _argv(reach: TaskReach, argv: list[str]) -> list[str]:
    if argv:
        return argv
    shell = reach.env.get("SHELL")
    for candidate in ((shell,) if shell else ()) + SHELLS:
        if candidate.startswith("/") and (reach.container or os.access(candidate, os.X_OK)):
            return [candidate, "-l"] if candidate.endswith("bash") else [candidate]
    return ["/bin/sh"]


def _popen_user(reach: TaskReach) -> dict:
    """Popen's user switch for a process task run as another user (the agent is root)."""
    if reach.user is None or reach.user[0] == os.geteuid():
        return {}
    uid, gid, groups = reach.user
    return {"user": uid, "group": gid, "extra_groups": list(groups)}


async def run_exec(process: asyncssh.SSHServerProcess, admission: Admission, docker_exec=None) -> None:
    """An exec session: the command in the task's environment, its output back, its exit
    status as the session's."""
    try:
        task_id, argv = parse_exec(process.command)
        reach = admission.task(task_id)
    except Refused as refused:
        logger.warning("tunnel: refused an exec: %s", refused)
        process.stderr.write(ACK_PREFIX + f"refused: {refused}\n".encode())
        process.exit(126)
        return
    process.stderr.write(ACK_PREFIX + b"ok\n")
    argv = _argv(reach, argv)
    logger.info("tunnel: exec in task %s: %s", reach.task_id, argv[0])
    try:
        if reach.container is not None:
            if docker_exec is None:
                raise OSError("this node's runtime cannot exec in a container")
            status = await docker_exec(process, reach, argv)
        elif process.get_terminal_type():
            status = await _exec_pty(process, reach, argv)
        else:
            status = await _exec_pipes(process, reach, argv)
    except OSError as error:
        process.stderr.write(f"cannot run {argv[0]}: {error}\n".encode())
        status = 127 if isinstance(error, FileNotFoundError) else 126
    with contextlib.suppress(OSError, asyncssh.Error):
        process.exit(status)


async def _exec_pipes(process: asyncssh.SSHServerProcess, reach: TaskReach, argv: list[str]) -> int:
    child = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(reach.env),
        cwd=reach.cwd,
        start_new_session=True,
        **_popen_user(reach),
    )

    async def copy_out(source, sink) -> None:
        while data := await source.read(READ_BYTES):
            sink.write(data)
            await sink.drain()

    async def copy_in() -> None:
        try:
            while True:
                try:
                    data = await process.stdin.read(READ_BYTES)
                except asyncssh.TerminalSizeChanged:
                    continue
                if not data:
                    break
                child.stdin.write(data)
                await child.stdin.drain()
        except (ConnectionError, asyncssh.Error):
            logger.debug("tunnel: an exec's input ended early")
        finally:
            with contextlib.suppress(OSError):
                child.stdin.close()

    feeder = asyncio.ensure_future(copy_in())
    watchdog = asyncio.ensure_future(_end_with_channel(process, child.pid))
    try:
        await asyncio.gather(copy_out(child.stdout, process.stdout), copy_out(child.stderr, process.stderr))
        return exit_status(await child.wait())
    finally:
        feeder.cancel()
        watchdog.cancel()
        _end_group(child.pid)


async def _exec_pty(process: asyncssh.SSHServerProcess, reach: TaskReach, argv: list[str]) -> int:
    master, slave = os.openpty()
    cols, rows, _, _ = process.get_terminal_size()
    _set_size(slave, cols, rows)
    env = dict(reach.env) | {"TERM": process.get_terminal_type() or "xterm"}
    try:
        child = subprocess.Popen(  # noqa: S603  (the user's own command, in their task)
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=reach.cwd,
            start_new_session=True,
            preexec_fn=_take_terminal,  # noqa: PLW1509  (one ioctl, after setsid)
            close_fds=True,
            **_popen_user(reach),
        )
    finally:
        os.close(slave)
    loop = asyncio.get_running_loop()
    output_done = loop.create_future()

    def readable() -> None:
        try:
            data = os.read(master, READ_BYTES)
        except OSError:  # EIO: every holder of the terminal has closed it
            data = b""
        if data:
            process.stdout.write(data)
            return
        loop.remove_reader(master)
        if not output_done.done():
            output_done.set_result(None)

    loop.add_reader(master, readable)

    async def copy_in() -> None:
        while True:
            try:
                data = await process.stdin.read(READ_BYTES)
            except asyncssh.TerminalSizeChanged as change:
                _set_size(master, change.width, change.height)
                continue
            except (ConnectionError, asyncssh.Error):
                return
            if not data:
                return
            await loop.run_in_executor(None, os.write, master, data)

    feeder = asyncio.ensure_future(copy_in())
    watchdog = asyncio.ensure_future(_end_with_channel(process, child.pid))
    try:
        await output_done
        returncode = await loop.run_in_executor(None, child.wait)
        return exit_status(returncode)
    finally:
        feeder.cancel()
        watchdog.cancel()
        loop.remove_reader(master)
        os.close(master)
        _end_group(child.pid)


async def _end_with_channel(process: asyncssh.SSHServerProcess, pgid: int) -> None:
    """The session went away (the user left, it timed out, the tunnel closed): its
    command and what it started end with it, not later."""
    await process.channel.wait_closed()
    _end_group(pgid)


def _end_group(pgid: int) -> None:
    """What the command left running in its session ends with the session."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def docker_exec_with(engine_client: Callable[[], object]):
    """An exec in a container task through the engine's API (`docker exec`): stdin in,
    stdout and stderr out (one stream with a TTY), the command's exit status."""

    async def docker_exec(process: asyncssh.SSHServerProcess, reach: TaskReach, argv: list[str]) -> int:
        loop = asyncio.get_running_loop()
        api = (await loop.run_in_executor(None, engine_client)).api
        tty = bool(process.get_terminal_type())
        env = {"TERM": process.get_terminal_type()} if tty else None
        created = await loop.run_in_executor(
            None, lambda: api.exec_create(reach.container, argv, stdin=True, tty=tty, environment=env)
        )
        exec_id = created["Id"]
        stream = await loop.run_in_executor(None, lambda: api.exec_start(exec_id, socket=True, tty=tty))
        sock = getattr(stream, "_sock", stream)
        cols, rows, _, _ = process.get_terminal_size()

        async def resize(width: int, height: int) -> None:
            if tty and width > 0 and height > 0:
                with contextlib.suppress(Exception):
                    await loop.run_in_executor(None, lambda: api.exec_resize(exec_id, height=height, width=width))

        await resize(cols, rows)

        def pump_out() -> None:  # in a thread: the engine's socket is a blocking one
            buffer = b""
            while True:
                data = sock.recv(READ_BYTES)
                if not data:
                    return
                if tty:
                    loop.call_soon_threadsafe(process.stdout.write, data)
                    continue
                buffer += data
                while len(buffer) >= 8:  # the engine's multiplexed frames: stream, 3 zeros, length
                    kind, size = buffer[0], struct.unpack(">I", buffer[4:8])[0]
                    if len(buffer) < 8 + size:
                        break
                    payload, buffer = buffer[8 : 8 + size], buffer[8 + size :]
                    sink = process.stderr if kind == 2 else process.stdout
                    loop.call_soon_threadsafe(sink.write, payload)

        async def copy_in() -> None:
            while True:
                try:
                    data = await process.stdin.read(READ_BYTES)
                except asyncssh.TerminalSizeChanged as change:
                    await resize(change.width, change.height)
                    continue
                except (ConnectionError, asyncssh.Error):
                    return
                if not data:
                    with contextlib.suppress(OSError):
                        await loop.run_in_executor(None, sock.shutdown, 1)  # SHUT_WR: the command's stdin ends
                    return
                await loop.run_in_executor(None, sock.sendall, data)

        async def end_with_channel() -> None:  # the exec's process does not end with its socket
            await process.channel.wait_closed()
            with contextlib.suppress(Exception):
                inspected = await loop.run_in_executor(None, lambda: api.exec_inspect(exec_id))
                if inspected.get("Running") and isinstance(inspected.get("Pid"), int) and inspected["Pid"] > 0:
                    os.kill(inspected["Pid"], signal.SIGKILL)  # the engine reports it as the host numbers it
            with contextlib.suppress(OSError):
                sock.shutdown(2)  # SHUT_RDWR: the pump's blocking read returns

        feeder = asyncio.ensure_future(copy_in())
        watchdog = asyncio.ensure_future(end_with_channel())
        try:
            await loop.run_in_executor(None, pump_out)
            inspected = await loop.run_in_executor(None, lambda: api.exec_inspect(exec_id))
            return int(inspected.get("ExitCode") or 0)
        finally:
            feeder.cancel()
            watchdog.cancel()
            with contextlib.suppress(OSError):
                sock.close()

    return docker_exec


# --- the connection ---------------------------------------------------------------------


class Tunnel:
    """Keeps the outbound connection: registers the host key, dials, serves, and dials
    again when the connection drops (0.5 s doubling to 5 s, jittered)."""

    def __init__(self, node_id: str, server_url: str, client, data_dir: Path, runtime, docker_exec=None):
        self.node_id, self.server_url, self.client = node_id, server_url, client
        self.data_dir, self.runtime, self.docker_exec = data_dir, runtime, docker_exec
        self.admission = Admission(runtime.reach)
        self.connected = threading.Event()  # set while a connection is up (tests, status)

    def register(self, key: asyncssh.SSHKey) -> dict:
        """POST the host key; the answer says where to dial and the control plane's key."""
        response = self.client.request(
            "POST",
            REGISTER_PATH.format(node_id=self.node_id),
            json={"host_key": key.export_public_key().decode().strip()},
            expect=(200,),
        )
        if response.status_code == 409:
            raise KeyRefused(response.json().get("error", {}).get("message", "host key refused"))
        if response.status_code != 200:
            raise ConnectionError(f"registering the tunnel: HTTP {response.status_code}")
        answer = response.json()
        return {
            "host": answer.get("host") or urlsplit(self.server_url).hostname,
            "port": int(answer["port"]),
            "client_key": asyncssh.import_public_key(answer["client_key"]),
        }

    def run(self, stop: threading.Event) -> None:
        asyncssh.set_log_level(logging.WARNING)  # not a line for each channel opened
        asyncio.run(self._run(stop))

    async def _run(self, stop: threading.Event) -> None:
        key = host_key(self.data_dir)
        delay, last_problem = RETRY_FIRST, ""
        while not stop.is_set():
            try:
                target = await asyncio.to_thread(self.register, key)
                conn = await asyncssh.connect_reverse(
                    target["host"],
                    target["port"],
                    server_factory=lambda target=target: TunnelServer(target["client_key"], self.admission),
                    server_host_keys=[key],
                    process_factory=lambda process: run_exec(process, self.admission, self.docker_exec),
                    encoding=None,
                    keepalive_interval=KEEPALIVE_SECONDS,
                    login_timeout=15,
                    allow_pty=True,
                    x11_forwarding=False,
                    agent_forwarding=False,
                    sftp_factory=None,
                )
            except KeyRefused as refused:
                logger.error("tunnel: the control plane refuses this node's host key: %s", refused)
                await _sleep_unless(stop, KEY_REFUSED_RETRY)
                continue
            except Exception as error:  # noqa: BLE001  (any failure: dial again later)
                problem = f"{type(error).__name__}: {error}"
                if problem != last_problem:  # not every retry: a control plane away for an hour
                    logger.warning("tunnel: cannot connect (%s); retrying", problem)
                    last_problem = problem
                await _sleep_unless(stop, delay * JITTER.uniform(0.8, 1.2))
                delay = min(delay * 2, RETRY_CAP)
                continue
            logger.info("tunnel: connected to %s:%s", target["host"], target["port"])
            self.connected.set()
            delay, last_problem, since = RETRY_FIRST, "", time.monotonic()
            closed = asyncio.ensure_future(conn.wait_closed())
            while not closed.done() and not stop.is_set():
                await asyncio.wait({closed}, timeout=0.5)
            self.connected.clear()
            if not closed.done():
                conn.close()
                await closed
                return
            logger.warning("tunnel: connection lost after %.0f s; reconnecting", time.monotonic() - since)


class KeyRefused(Exception):
    """The control plane pins another host key for this node."""


async def _sleep_unless(stop: threading.Event, seconds: float) -> None:
    ends = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < ends:
        await asyncio.sleep(min(0.2, max(0.0, ends - time.monotonic())))
