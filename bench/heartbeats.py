"""Heartbeat ingestion benchmark: N simulated agents (8 GPUs each, realistic payloads)
post heartbeats over HTTP, on their 5 s schedule, to the control plane running as in
production (uvicorn ASGI workers, PostgreSQL). Then: the node list at 100 and 10,000
nodes, and 1,000 nodes going silent and coming back at once.

    make bench                                     # defaults: 2,000 nodes, 30 s
    .venv/bin/python bench/heartbeats.py --nodes 2000 --duration 30 --workers 2

Uses DATABASE_URL / REDIS_URL when set, else starts the embedded pair in a scratch
folder. Always works in a database of its own, heteroflow_bench, which it drops and
creates at the start and drops at the end: on a shared server, that name must be free.
Prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from heteroflow.embedded import ensure_data_stores  # noqa: E402
from heteroflow.launcher import web_command  # noqa: E402
from tests.nodes.payloads import heartbeat  # noqa: E402

BENCH_DB = "heteroflow_bench"


def say(message: str) -> None:
    print(message, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + name))


def recreate_database(admin_url: str, name: str = BENCH_DB) -> str:
    """A benchmark's own database, empty, on the server `admin_url` names; its URL."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return with_database(admin_url, name)


def drop_database(admin_url: str, name: str = BENCH_DB) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


# --- the load generator ---------------------------------------------------------------


class Connection:
    """A keep-alive HTTP/1.1 connection speaking just enough HTTP for the benchmark, so
    the generator spends its CPU on sending, not on a client library."""

    def __init__(self, port: int):
        self.port = port
        self.reader = self.writer = None

    async def open(self):
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            await self.open()
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        body = await self.reader.readexactly(length) if length else b""
        return status, body


def beat_request(node_id: str, secret: str, body: bytes) -> bytes:
    return (
        f"POST /api/v1/nodes/{node_id}/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"X-API-Key: {secret}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def run_load(
    port: int, secret: str, nodes: int, duration: float, interval: float, connections: int, between=None
):
    payload = heartbeat(gpus=8)
    requests = []
    for n in range(nodes):
        body = dict(payload, hostname=f"gpu-node-{n:05d}", internal_ip=f"10.{n // 65536}.{n // 256 % 256}.{n % 256}")
        requests.append(beat_request(f"bench-{n:05d}", secret, orjson.dumps(body)))
    size = len(requests[0])
    pool: asyncio.Queue[Connection] = asyncio.Queue()
    for _ in range(connections):
        pool.put_nowait(Connection(port))
    latencies: list[float] = []
    timeline: list[tuple[float, float]] = []  # (due, latency)
    errors: dict[int, int] = {}

    async def send(raw: bytes, record: bool, due: float | None = None):
        # Latency counts from when the beat was due, so time spent waiting for a free
        # connection (queueing in the client) is in the figure too.
        started = due if due is not None else time.perf_counter()
        conn = await pool.get()
        try:
            status, _ = await conn.request(raw)
        except (OSError, asyncio.IncompleteReadError):
            status, conn = -1, Connection(port)
        finally:
            pool.put_nowait(conn)
        if record:
            latencies.append(time.perf_counter() - started)
            timeline.append((started, latencies[-1]))
            if status != 200:
                errors[status] = errors.get(status, 0) + 1

    say(f"registering {nodes} nodes (first beats take the slow path)…")
    started = time.perf_counter()
    await asyncio.gather(*(send(raw, record=False) for raw in requests))
    say(f"  registered in {time.perf_counter() - started:.1f} s")
    if between:
        between()

    say(
        f"steady state: {nodes} nodes every {interval:g} s for {duration:g} s "
        f"(offered {nodes / interval:.0f}/s, {size} bytes each)…"
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.5
    clock_offset = time.perf_counter() - loop.time()
    tasks = []
    beats = int(duration / interval * nodes)
    for k in range(beats):
        # each node keeps its phase: node n beats at t0 + n/nodes*interval + round*interval
        round_, n = divmod(k, nodes)
        at = t0 + (n / nodes + round_) * interval
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send(requests[n], record=True, due=at + clock_offset)))
    await asyncio.gather(*tasks)
    elapsed = loop.time() - t0
    start = t0 + clock_offset
    windows: dict[int, list[float]] = {}
    for due, latency in timeline:
        windows.setdefault(int((due - start) // interval), []).append(latency)
    window_p99s = ", ".join(f"{percentile(v, 0.99) * 1000:.0f}" for _, v in sorted(windows.items()))
    say(f"  p99 per {interval:g} s window: {window_p99s}")
    return latencies, errors, elapsed


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# --- the server -----------------------------------------------------------------------


def server_env(database_url: str, redis_url: str, data_dir: Path, secret: str) -> dict:
    # The caller's tuning variables (pool sizes…) pass through; the ones below are ours.
    env = dict(os.environ)
    env.update(
        HETEROFLOW_ENV="production",
        SECRET_KEY=secrets.token_urlsafe(50),
        HETEROFLOW_AGENT_SECRET=secret,
        ALLOWED_HOSTS="127.0.0.1,localhost",
        HETEROFLOW_SSL_REDIRECT="false",
        HETEROFLOW_DATA_DIR=str(data_dir),
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        HETEROFLOW_LOG_LEVEL="warning",
        DJANGO_SETTINGS_MODULE="heteroflow.settings",
    )
    return env


def wait_for(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"server at {url} did not come up")


def table_counters(database_url: str) -> dict:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        commits = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()[0]
        rows = dict(
            conn.execute(
                "SELECT relname, n_tup_upd + n_tup_ins FROM pg_stat_user_tables "
                "WHERE relname IN ('nodes', 'gpus') OR relname LIKE 'node_metrics_%'"
            ).fetchall()
        )
    rows["node_metrics"] = sum(v for k, v in rows.items() if k.startswith("node_metrics_"))
    return {
        "commits": commits,
        "nodes": rows.get("nodes", 0),
        "gpus": rows.get("gpus", 0),
        "node_metrics": rows["node_metrics"],
    }


def statements_per_steady_beat(env: dict) -> list[str]:
    """One more steady beat, in this process, through the same ingest code, counting
    what it sends to PostgreSQL."""
    code = r"""
import asyncio, psycopg, django
django.setup()
from apps.core.clock import utcnow
from apps.core.db import libpq_params
from apps.nodes import heartbeat
from tests.nodes.payloads import heartbeat as payload
seen = []
original = psycopg.AsyncCursor.execute
async def counting(cursor, query, params=None, **kw):
    seen.append(str(query).split()[0].upper())
    return await original(cursor, query, params, **kw)
psycopg.AsyncCursor.execute = counting
async def main():
    async with await psycopg.AsyncConnection.connect(**libpq_params(autocommit=True)) as conn:
        body = dict(payload(gpus=8), hostname="gpu-node-00000", internal_ip="10.0.0.0")
        await heartbeat.ingest(conn, "bench-00000", body, "127.0.0.1", utcnow())
asyncio.run(main())
print(" ".join(seen))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return result.stdout.split()


# --- list and health-check scaling ----------------------------------------------------


def seed_nodes(database_url: str, count: int) -> None:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("TRUNCATE nodes CASCADE")
        conn.execute(
            (
                "\n"
                "            INSERT INTO nodes (id, name, status, ip, internal_ip, mac, hostname, os, cpu_cores, "
                "memory_gb, is_container,\n"
                "                docker_available, executable, exec_mode, error_message, agent_version, "
                "agent_git_commit, agent_build_time,\n"
                "                heartbeat_interval, gpu_type, gpu_model, gpu_count, gpu_collector_error, labels, "
                "gpu_capabilities,\n"
                "                inference_engines, inference_engine_versions, vllm_available, discovered_models, "
                "task_health, live_task_ids,\n"
                "                region, zone, rack, structure_hash, version, registered_at, last_heartbeat_at, "
                "updated_at, agent_label_keys)\n"
                "            SELECT 'seed-' || lpad(i::text, 6, '0'), 'node-' || lpad(i::text, 6, '0'), 'online', "
                "'198.18.0.1'::inet + i,\n"
                "                '10.0.0.1'::inet + i, '', 'h', 'linux', 128, 1024, false, true, true, 'docker', '', "
                "'2.4.1', 'abc', 'now',\n"
                "                5, 'nvidia', 'H100', 8, '', '{\"heteroflow.network_zone\": \"vpc-a\"}', '{}', "
                "'[\"vllm\"]', '{}', true, '[]', '[]', '[]',\n"
                "                'cn-north', 'az' || (i %% 3), 'r' || (i %% 40), '', 1, now(), now(), now(), '[]'\n"
                "            FROM generate_series(1, %s) AS i\n"
                "            "
            ),
            [count],
        )
        conn.execute(
            "\n"
            "            INSERT INTO gpus (node_id, index, uuid, vendor, model, memory_total_mb, "
            "compute_capability, utilization,\n"
            "                memory_used_mb, temperature, power_w, metrics_available, absent_streak, absent_basis, "
            "present_streak,\n"
            "                lost_basis, updated_at)\n"
            "            SELECT n.id, g, 'GPU-' || n.id || '-' || g, 'nvidia', 'NVIDIA H100 80GB HBM3', 81559, "
            "'9.0', 30, 1000, 50, 300,\n"
            "                '[\"utilization\"]', 0, 0, 0, '', now()\n"
            "            FROM nodes n, generate_series(0, 7) AS g\n"
            "            "
        )
        conn.execute("ANALYZE nodes")
        conn.execute("ANALYZE gpus")
        conn.execute("ANALYZE node_search")  # the search table the triggers filled (nodes/0007)


def time_list(port: int, key: str, nodes: int, requests: int = 200) -> list[float]:
    """Full pages of 100, spread over the fleet (the 100-node fleet has one page)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port)
    latencies = []
    pages = max(1, nodes // 100)
    for i in range(requests + 10):
        started = time.perf_counter()
        conn.request(
            "GET",
            f"/api/v1/nodes?limit=100&offset={(i * 37 % pages) * 100}",
            headers={"Authorization": f"Bearer {key}"},
        )
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise SystemExit(f"node list answered {response.status}")
        if len(orjson.loads(body)["results"]) != 100:
            raise SystemExit("node list page is not full")
        if i >= 10:  # warm-up
            latencies.append(time.perf_counter() - started)
    return latencies


# Searches a user types (issue 20's case: `?q=` was p99 210 ms at 10,000 nodes): a node
# name, a rack, an address prefix, the fleet's GPU model (every node matches), nothing.
SEARCHES = ("node-00042", "r17", "198.18.3.", "h100", "nomatch")
SEARCH_TARGET_P99_MS = 50


def time_search(port: int, key: str, requests: int = 200) -> dict[str, list[float]]:
    """GET /api/v1/nodes?q=…&limit=100, each search in turn; latencies per search."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port)
    latencies: dict[str, list[float]] = {q: [] for q in SEARCHES}
    for i in range(requests + 10):
        q = SEARCHES[i % len(SEARCHES)]
        started = time.perf_counter()
        conn.request("GET", f"/api/v1/nodes?limit=100&q={q}", headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise SystemExit(f"node search answered {response.status}")
        if (q == "nomatch") != (orjson.loads(body)["count"] == 0):
            raise SystemExit(f"node search for {q!r} found the wrong nodes")
        if i >= 10:  # warm-up
            latencies[q].append(time.perf_counter() - started)
    return latencies


def health_pass(env: dict, database_url: str, silent: int) -> tuple[float, int, float, int]:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE nodes SET last_heartbeat_at = now(), status = 'online'")
        conn.execute(
            "UPDATE nodes SET last_heartbeat_at = now() - interval '2 minutes' "
            "WHERE id IN (SELECT id FROM nodes ORDER BY id LIMIT %s)",
            [silent],
        )
    code = (
        "\n"
        "import time, django\n"
        "django.setup()\n"
        "from apps.nodes.services import refresh_node_statuses\n"
        "from django.db import connection\n"
        "def timed():\n"
        "    t = time.perf_counter(); changed = refresh_node_statuses(); "
        "return time.perf_counter() - t, sum(map(len, changed.values()))\n"
        "gone = timed()\n"
        "with connection.cursor() as c:\n"
        "    c.execute(\"UPDATE nodes SET last_heartbeat_at = now() WHERE status = 'offline'\")\n"
        "back = timed()\n"
        "print(gone[0], gone[1], back[0], back[1])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    gone_s, gone_n, back_s, back_n = result.stdout.split()
    return float(gone_s), int(gone_n), float(back_s), int(back_n)


def run_heartbeats(args, port: int, secret: str, database_url: str, env: dict) -> None:
    before = {}
    latencies, errors, elapsed = asyncio.run(
        run_load(
            port,
            secret,
            args.nodes,
            args.duration,
            args.interval,
            args.connections,
            between=lambda: before.update(table_counters(database_url)),
        )
    )
    after = table_counters(database_url)
    done = len(latencies)
    say("\n== heartbeats ==")
    say(
        f"  heartbeats           {done} in {elapsed:.1f} s = {done / elapsed:.0f}/s "
        f"(offered {args.nodes / args.interval:.0f}/s)"
    )
    say(
        f"  latency              p50 {percentile(latencies, 0.5) * 1000:.1f} ms, "
        f"p99 {percentile(latencies, 0.99) * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms"
    )
    say(f"  errors               {sum(errors.values())} {errors or ''}")
    commits = after["commits"] - before["commits"]
    say(
        f"  per heartbeat        {commits / done:.2f} commits, "
        f"{(after['nodes'] - before['nodes']) / done:.2f} node rows, "
        f"{(after['gpus'] - before['gpus']) / done:.2f} GPU rows, "
        f"{(after['node_metrics'] - before['node_metrics']) / done:.2f} metric rows"
    )
    statements = statements_per_steady_beat(env)
    say(
        f"  statements per steady-state beat: {len(statements)} "
        f"({' + '.join(statements)}: node UPDATE + GPU UPDATE + metrics INSERT as one statement)"
    )


def start_server(env: dict, workers: int, *extra: str) -> tuple[subprocess.Popen, int]:
    """The control plane's web process as `make up` starts it, with `workers` processes,
    on a free port; returns once /health answers."""
    port = free_port()
    server = subprocess.Popen(
        web_command("127.0.0.1", port, "--workers", str(workers), "--no-access-log", *extra, "--log-level", "warning"),
        cwd=REPO,
        env=env,
        start_new_session=True,
    )
    wait_for(f"http://127.0.0.1:{port}/health")
    return server, port


def stores_in_use(stores) -> str:
    return ", ".join(stores.embedded) + " embedded" if stores.embedded else "from DATABASE_URL / REDIS_URL"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--skip-list", action="store_true", help="skip the node-list and health-check parts")
    parser.add_argument("--list-only", action="store_true", help="only the node-list and health-check parts")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="hf-bench-"))
    (scratch / "static").mkdir()  # production serves collected static files from here
    stores = ensure_data_stores(scratch, os.environ)
    admin_url = stores.database_url
    recreate_database(admin_url)
    database_url = with_database(admin_url, BENCH_DB)
    secret = secrets.token_urlsafe(24)
    env = server_env(database_url, stores.redis_url, scratch, secret)
    server = None
    try:
        subprocess.run(
            [sys.executable, "manage.py", "migrate_schemas", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True
        )
        server, port = start_server(env, args.workers, "--loop", "uvloop", "--http", "httptools")
        where = stores_in_use(stores)
        say(
            f"server: uvicorn, {args.workers} workers, production settings; "
            f"data stores: {where}; machine: {os.cpu_count()} cores"
        )

        if not args.list_only:
            run_heartbeats(args, port, secret, database_url, env)
        if not args.skip_list:
            key = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import django; django.setup(); from django.contrib.auth import get_user_model; "
                    "from apps.tenants.services import issue_platform_key; "
                    "u = get_user_model().objects.create_superuser('bench', 'b@x', 'x'); "
                    "print(issue_platform_key(user=u, name='bench').key)",
                ],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            say("\n== node list (GET /api/v1/nodes?limit=100, 8 GPUs per node) ==")
            results = {}
            for count in (100, 10_000):
                seed_nodes(database_url, count)
                lat = time_list(port, key, count)
                results[count] = percentile(lat, 0.99)
                say(
                    f"  {count:>6} nodes        p50 {percentile(lat, 0.5) * 1000:.1f} ms, "
                    f"p99 {results[count] * 1000:.1f} ms"
                )
            say(f"  slowdown 100 → 10,000 nodes at p99: {results[10_000] / results[100]:.2f}x")
            say("\n== node search (GET /api/v1/nodes?q=…&limit=100, 10,000 nodes) ==")
            searched = time_search(port, key)
            every = [value for values in searched.values() for value in values]
            for q, lat in searched.items():
                say(f"  q={q:<12} p50 {percentile(lat, 0.5) * 1000:.1f} ms, p99 {percentile(lat, 0.99) * 1000:.1f} ms")
            p99 = percentile(every, 0.99) * 1000
            verdict = "PASS" if p99 <= SEARCH_TARGET_P99_MS else "FAIL"
            say(f"  {verdict}  all searches p99 {p99:.1f} ms (<= {SEARCH_TARGET_P99_MS} ms)")
            say("\n== 1,000 nodes going silent together, then coming back (health-check passes) ==")
            for count in (1_000, 10_000):
                seed_nodes(database_url, count)
                gone_s, gone_n, back_s, back_n = health_pass(env, database_url, silent=1_000)
                say(
                    f"  fleet {count:>6}: silent pass {gone_s * 1000:.1f} ms ({gone_n} changed), "
                    f"return pass {back_s * 1000:.1f} ms ({back_n} changed)"
                )
        return 0
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        drop_database(admin_url)
        stores.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
