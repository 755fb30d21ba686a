"""`make bench-tunnel`: the tunnel's figures on loopback (docs/tunnel.md#benchmarks).

1. The whole path of a user's session: `hf port-forward`'s SDK (a local port, a WebSocket
   per connection) -> the web process (uvicorn, the WebSocket route) -> the relay ->
   the tunnel process (`manage.py tunnel`) -> SSH -> the agent's end (its TunnelServer
   and admission, dialling out with connect_reverse after registering its key through
   the API) -> a "task" port (a TCP sink on localhost). The web and tunnel processes are
   started as `make up` starts them, in a database of their own
   (heteroflow_bench_tunnel, dropped before and after; DATABASE_URL / REDIS_URL when
   set, else the embedded pair). Throughput, added latency per request (p50) and 200
   concurrent sessions through it.
2. The SSH hop alone, in this process: the agent's own end (heteroflow_agent.tunnel:
   TunnelServer and its admission, connect_reverse) against asyncssh's listen_reverse
   as the control plane, with a stand-in "task" (a TCP server on localhost whose port
   the admission admits):

- throughput: bytes pushed through one direct-tcpip channel (MB/s);
- added latency: an HTTP-like request/answer through a channel against the same on a
  direct connection (p50, µs);
- 200 concurrent channels on one node, each moving the same bytes: the slowest against
  the fastest (starving would show as a large spread);
- an idle tunnel: the process's memory per held connection (RSS over N idle reverse
  connections), and its keepalive traffic per second (measured over a window with the
  keepalive shortened, then scaled to the 30 s keepalive).

The load generator, the agent's end and the sink share this process (one core of a
small machine): the figures are a floor."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncssh
import psutil
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "agent"))
sys.path.insert(0, str(REPO / "client"))
from heteroflow_client import tunnel as hf_tunnel  # noqa: E402

from bench.heartbeats import drop_database, free_port, recreate_database, server_env, start_server  # noqa: E402
from heteroflow.embedded import ensure_data_stores  # noqa: E402
from heteroflow.launcher import tunnel_command  # noqa: E402
from heteroflow_agent import tunnel  # noqa: E402
from heteroflow_agent.runtime.base import TaskReach  # noqa: E402

CHUNK = 256 * 1024
DB_NAME = "heteroflow_bench_tunnel"
NODE = "bench-node"
THROUGHPUT_TARGET, LATENCY_TARGET_US = 50.0, 2000.0

SETUP = r"""
import django
django.setup()
from apps.core.clock import utcnow
from apps.core.principals import Principal, PrincipalKind
from apps.nodes.models import Node
from apps.tasks.models import Task
from apps.tenants import services as tenants
from apps.tenants.choices import Role
from django.contrib.auth import get_user_model

tenant = tenants.create_tenant(name="Bench", slug="bench")
user = get_user_model().objects.create(username="bench")
tenants.add_member(tenant, username="bench", role=Role.MEMBER)
owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=Role.MEMBER)
key = tenants.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name="bench").key
node = Node.objects.create(id="bench-node", name="bench-node", status="online", last_heartbeat_at=utcnow())
task = Task.objects.create(
    tenant=tenant, name="t", image="x", command=["x"], status="running", node=node, gpu_required=0
)
print(task.pk, key)
"""


async def sink_server():
    async def handle(reader, writer):
        while data := await reader.read(CHUNK):
            if data.startswith(b"PING"):
                writer.write(b"PONG" + b"x" * 96)
                await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def plane_and_node(task_port: int, nodes: int = 1, keepalive: float = 30.0):
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    conns: list = []
    acceptor = await asyncssh.listen_reverse(
        "127.0.0.1", 0, client_keys=[client_key], known_hosts=None, username=tunnel.USERNAME, acceptor=conns.append
    )
    port = acceptor.get_port()
    admission = tunnel.Admission(lambda task_id: TaskReach(task_id, "127.0.0.1"))
    agents = []
    for _ in range(nodes):
        key = asyncssh.generate_private_key("ssh-ed25519")
        agents.append(
            await asyncssh.connect_reverse(
                "127.0.0.1",
                port,
                server_factory=lambda: tunnel.TunnelServer(client_key, admission),
                server_host_keys=[key],
                encoding=None,
                keepalive_interval=keepalive,
            )
        )
    while len(conns) < nodes:
        await asyncio.sleep(0.01)
    return acceptor, conns, agents


async def throughput_to(open_pair, seconds: float) -> float:
    reader, writer = await open_pair()
    block, sent, ends = b"\0" * CHUNK, 0, time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < ends:
        writer.write(block)
        await writer.drain()
        sent += len(block)
    writer.write_eof()
    await reader.read()
    return sent / (time.perf_counter() - start) / 1e6


async def concurrent_to(open_pair, sessions: int, per_session: int) -> list[float]:
    async def one() -> float:
        reader, writer = await open_pair()
        start = time.perf_counter()
        block = b"\0" * 16384
        for _ in range(per_session // len(block)):
            writer.write(block)
            await writer.drain()
        writer.write_eof()
        await reader.read()
        return time.perf_counter() - start

    return await asyncio.gather(*(one() for _ in range(sessions)))


async def latencies(open_pair, rounds: int) -> list[float]:
    reader, writer = await open_pair()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        writer.write(b"PING /\r\n\r\n")
        await writer.drain()
        await reader.readexactly(100)
        times.append((time.perf_counter() - start) * 1e6)
    writer.close()
    return times


def verdict(value: float, target: float, at_most: bool = False) -> str:
    return "PASS" if (value <= target if at_most else value >= target) else "FAIL"


async def agent_end(base: str, secret: str, agents: list) -> None:
    """The agent's end, as the agent runs it: register the key, dial, serve."""
    key = asyncssh.generate_private_key("ssh-ed25519")
    answer = requests.post(
        f"{base}/api/v1/nodes/{NODE}/tunnel",
        json={"host_key": key.export_public_key().decode()},
        headers={"X-API-Key": secret},
        timeout=10,
    )
    answer.raise_for_status()
    target = answer.json()
    admission = tunnel.Admission(lambda task_id: TaskReach(task_id, "127.0.0.1"))
    client_key = asyncssh.import_public_key(target["client_key"])
    for _ in range(150):  # the tunnel process may still be starting: dial again, as the agent does
        try:
            agents.append(
                await asyncssh.connect_reverse(
                    target["host"] or "127.0.0.1",
                    target["port"],
                    server_factory=lambda: tunnel.TunnelServer(client_key, admission),
                    server_host_keys=[key],
                    encoding=None,
                    keepalive_interval=30,
                )
            )
            return
        except OSError:
            await asyncio.sleep(0.2)
    raise SystemExit("the tunnel process did not take the connection")


async def whole_path(args, base: str, key: str, task_id: int, secret: str, task_port: int) -> None:
    agents: list = []
    await agent_end(base, secret, agents)
    deadline = time.monotonic() + 30
    while True:  # until the tunnel process has recorded the node in Redis
        try:
            session = await hf_tunnel._connect(base, key, f"/api/v1/tasks/{task_id}/tunnel", {"port": task_port})
            await session.close()
            break
        except hf_tunnel.ApiError as error:
            if error.status != 503 or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    ready = asyncio.get_running_loop().create_future()
    forward = asyncio.ensure_future(
        hf_tunnel.serve_port_forward(base, key, task_id, 0, task_port, on_ready=ready.set_result, check_first=False)
    )
    local = await ready
    try:
        mbs = await throughput_to(lambda: asyncio.open_connection("127.0.0.1", local), args.seconds)
        print(
            f"whole path, throughput of one session: {mbs:.0f} MB/s "
            f"(target >= {THROUGHPUT_TARGET:.0f}: {verdict(mbs, THROUGHPUT_TARGET)})"
        )
        direct = await latencies(lambda: asyncio.open_connection("127.0.0.1", task_port), args.rounds)
        forwarded = await latencies(lambda: asyncio.open_connection("127.0.0.1", local), args.rounds)
        added = statistics.median(forwarded) - statistics.median(direct)
        print(
            f"whole path, request latency p50: direct {statistics.median(direct):.0f} us, forwarded "
            f"{statistics.median(forwarded):.0f} us, added {added:.0f} us "
            f"(target <= {LATENCY_TARGET_US:.0f}: {verdict(added, LATENCY_TARGET_US, at_most=True)})"
        )
        times = await concurrent_to(
            lambda: asyncio.open_connection("127.0.0.1", local), args.sessions, args.per_session
        )
        spread(f"whole path, {args.sessions} concurrent sessions", args, times)
    finally:
        forward.cancel()
        await asyncio.gather(forward, return_exceptions=True)
        for agent in agents:
            agent.close()


def spread(label: str, args, times: list[float]) -> None:
    print(
        f"{label}, {args.per_session // 1024} KiB each: all done; fastest {min(times) * 1000:.0f} ms, "
        f"median {statistics.median(times) * 1000:.0f} ms, slowest {max(times) * 1000:.0f} ms "
        f"(slowest/median {max(times) / statistics.median(times):.1f})"
    )


def run_whole_path(args) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="hf-bench-tunnel-"))
    (scratch / "static").mkdir()
    stores = ensure_data_stores(scratch, os.environ)
    database_url = recreate_database(stores.database_url, DB_NAME)
    secret = secrets.token_urlsafe(24)
    env = server_env(database_url, stores.redis_url, scratch, secret) | {
        "HETEROFLOW_TUNNEL_PORT": str(free_port()),
        "HETEROFLOW_TUNNEL_RELAY_PORT": str(free_port()),
        "HETEROFLOW_TUNNEL_PUBLIC_HOST": "127.0.0.1",
    }
    processes = []
    try:
        subprocess.run(
            [sys.executable, "manage.py", "migrate_schemas", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True
        )
        out = subprocess.run(
            [sys.executable, "-c", SETUP], cwd=REPO, env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        task_id, key = int(out[-2]), out[-1]
        processes.append(subprocess.Popen(tunnel_command(), cwd=REPO, env=env, start_new_session=True))
        server, port = start_server(env, 1)
        processes.append(server)

        async def go():
            sink = await sink_server()
            try:
                await whole_path(
                    args, f"http://127.0.0.1:{port}", key, task_id, secret, sink.sockets[0].getsockname()[1]
                )
            finally:
                sink.close()

        asyncio.run(go())
    finally:
        for process in processes:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        drop_database(stores.database_url, DB_NAME)
        stores.stop()


async def main(args) -> None:
    server = await sink_server()
    task_port = server.sockets[0].getsockname()[1]
    acceptor, conns, agents = await plane_and_node(task_port)
    conn = conns[0]
    mbs = await throughput_to(lambda: conn.open_connection("task-1", task_port), args.seconds)
    print(f"SSH hop alone, throughput of one channel: {mbs:.0f} MB/s")

    direct = await latencies(lambda: asyncio.open_connection("127.0.0.1", task_port), args.rounds)
    tunnelled = await latencies(lambda: conn.open_connection("task-1", task_port), args.rounds)
    added = statistics.median(tunnelled) - statistics.median(direct)
    print(
        f"SSH hop alone, request latency p50: direct {statistics.median(direct):.0f} us, through the channel "
        f"{statistics.median(tunnelled):.0f} us, added {added:.0f} us"
    )
    times = await concurrent_to(lambda: conn.open_connection("task-1", task_port), args.sessions, args.per_session)
    spread(f"SSH hop alone, {args.sessions} concurrent channels on one node", args, times)
    for agent in agents:
        agent.close()
    acceptor.close()

    server.close()


# --- an idle tunnel's cost --------------------------------------------------------------


async def idle_plane(args) -> None:
    """The control plane's side in a process of its own (so its memory is its own): a
    listen_reverse holding `idle_nodes` connections dialled by a child process through a
    proxy that counts every byte; prints one JSON line."""
    gc.collect()
    before = psutil.Process(os.getpid()).memory_info().rss
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    conns: list = []
    acceptor = await asyncssh.listen_reverse(
        "127.0.0.1",
        0,
        client_keys=[client_key],
        known_hosts=None,
        username=tunnel.USERNAME,
        acceptor=conns.append,
        keepalive_interval=args.idle_keepalive,
    )
    counted = [0]

    async def pipe(reader, writer):
        while data := await reader.read(65536):
            counted[0] += len(data)
            writer.write(data)
            await writer.drain()
        writer.close()

    async def proxied(reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", acceptor.get_port())
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    proxy = await asyncio.start_server(proxied, "127.0.0.1", 0)
    with tempfile.NamedTemporaryFile("w", suffix=".pub", delete=False) as handle:
        handle.write(client_key.export_public_key().decode())
    agents = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--idle-agents",
        str(proxy.sockets[0].getsockname()[1]),
        handle.name,
        "--idle-nodes",
        str(args.idle_nodes),
        "--idle-keepalive",
        str(args.idle_keepalive),
        stdin=asyncio.subprocess.PIPE,
    )
    while len(conns) < args.idle_nodes:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1)  # the handshakes' bytes are behind us
    gc.collect()
    held = psutil.Process(os.getpid()).memory_info().rss
    counted[0] = 0
    await asyncio.sleep(args.idle_seconds)
    idle_bytes = counted[0]
    agents.stdin.close()
    await agents.wait()
    acceptor.close()
    print(
        json.dumps(
            {
                "memory_per_node": (held - before) / args.idle_nodes,
                "bytes_per_node_second": idle_bytes / args.idle_seconds / args.idle_nodes,
            }
        )
    )


async def idle_agents(args) -> None:
    """The nodes' side: `idle_nodes` reverse connections, held until stdin closes."""
    client_key = asyncssh.read_public_key(args.idle_agents[1])
    admission = tunnel.Admission(lambda task_id: None)
    held = [
        await asyncssh.connect_reverse(
            "127.0.0.1",
            int(args.idle_agents[0]),
            server_factory=lambda: tunnel.TunnelServer(client_key, admission),
            server_host_keys=[asyncssh.generate_private_key("ssh-ed25519")],
            encoding=None,
            keepalive_interval=args.idle_keepalive,
        )
        for _ in range(args.idle_nodes)
    ]
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for conn in held:
        conn.close()


def run_idle(args) -> None:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--idle-plane",
            "--idle-nodes",
            str(args.idle_nodes),
            "--idle-seconds",
            str(args.idle_seconds),
            "--idle-keepalive",
            str(args.idle_keepalive),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = json.loads(out.strip().splitlines()[-1])
    memory, rate = found["memory_per_node"], found["bytes_per_node_second"]
    at_30 = rate * args.idle_keepalive / 30  # both ends keep alive every 30 s in the product
    print(
        f"idle tunnel ({args.idle_nodes} nodes held {args.idle_seconds:g} s): {memory / 1024:.1f} KiB of the control "
        f"plane's memory per node; {rate:.0f} B/s per node with keepalives every {args.idle_keepalive:g} s, "
        f"so {at_30:.1f} B/s per node at the product's 30 s"
    )
    print(
        f"10,000 idle nodes: about {memory * 10_000 / 2**20:.0f} MiB of tunnel-process memory, "
        f"{at_30 * 10_000 / 1024:.0f} KiB/s ({at_30 * 10_000 * 8 / 1e6:.2f} Mbit/s) of keepalives"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--per-session", type=int, default=1024 * 1024)
    parser.add_argument("--idle-nodes", type=int, default=200)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--idle-keepalive", type=float, default=1.0, help="keepalive while measuring (scaled to 30 s)")
    parser.add_argument("--no-whole-path", action="store_true", help="only the SSH hop (no database, no servers)")
    parser.add_argument("--idle-plane", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--idle-agents", nargs=2, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.idle_plane:
        asyncio.run(idle_plane(arguments))
    elif arguments.idle_agents:
        asyncio.run(idle_agents(arguments))
    else:
        if not arguments.no_whole_path:
            run_whole_path(arguments)
        asyncio.run(main(arguments))
        run_idle(arguments)
