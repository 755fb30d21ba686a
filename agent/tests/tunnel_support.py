"""What the tunnel's agent tests share (agent/tests/test_tunnel.py and
agent/tests/runtime/test_docker_tunnel.py): a stand-in control plane (asyncssh's
listen_reverse on a thread's event loop) and small channel helpers."""

from __future__ import annotations

import asyncio
import socket
import threading

import asyncssh
from agent.tests.waiting import wait_for

from heteroflow_agent import tunnel


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ControlPlane:
    """listen_reverse on a thread's event loop: `call(coro_fn)` runs `coro_fn(conn)` with
    the agent's connection once it is there."""

    def __init__(self, port: int):
        self.port, self.key = port, asyncssh.generate_private_key("ssh-ed25519")
        self.loop = asyncio.new_event_loop()
        self.conns: list = []
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.listen()

    def listen(self) -> None:
        async def start():
            return await asyncssh.listen_reverse(
                "127.0.0.1",
                self.port,
                client_keys=[self.key],
                known_hosts=None,
                username=tunnel.USERNAME,
                acceptor=self.conns.append,
                reuse_address=True,
            )

        self.acceptor = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def stop_listening(self) -> None:
        async def stop():
            self.acceptor.close()
            for conn in self.conns:
                conn.close()
            self.conns.clear()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)

    def call(self, fn, timeout: float = 30):
        conn = wait_for(
            lambda: self.conns and not self.conns[-1].is_closed() and self.conns[-1], 30, "the agent to dial"
        )
        return asyncio.run_coroutine_threadsafe(fn(conn), self.loop).result(timeout)

    def close(self) -> None:
        self.stop_listening()
        self.loop.call_soon_threadsafe(self.loop.stop)


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def http_get(conn, host: str, port: int) -> bytes:
    reader, writer = await conn.open_connection(host, port)
    writer.write(b"GET / HTTP/1.0\r\n\r\n")
    writer.write_eof()
    data = await reader.read()
    writer.close()
    return data


async def refusal(conn, host: str, port: int) -> str:
    try:
        await conn.open_connection(host, port)
    except asyncssh.ChannelOpenError as refused:
        return refused.reason
    return ""
