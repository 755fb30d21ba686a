"""Heartbeat ingestion benchmark: N simulated agents (8 GPUs each, realistic payloads)
post heartbeats over HTTP to the control plane running as in production (uvicorn ASGI
workers, PostgreSQL, and by default a Celery worker and beat running every periodic
job on its period). Then: the node list at 100 and 10,000 nodes, and 1,000 nodes going
silent and coming back at once.

    make bench                                     # defaults: 2,000 nodes, 30 s, each reading kind
    make bench BENCH_ARGS="--nodes 1000 --mode closed --connections 48"
    make bench BENCH_ARGS="--nodes 10000 --mode closed --skip-list"
    .venv/bin/python bench/heartbeats.py --nodes 2000 --duration 30 --workers 2

Two load modes: `schedule` (open loop: each node beats every --interval seconds at its
own phase) and `closed` (each of --connections connections sends its next beat as soon
as the last was answered, cycling over the nodes). Two kinds of readings, run one after
the other on the same fleet: `steady` (the same readings every beat) and `busy`
(bench/busy.py: memory use, power and utilisation moving every beat, ECC counts growing
now and then). Beside rate and latency it prints the database's deadlocks and lock
waits, each periodic job's runs and run times, and the error lines in the processes'
logs.

Uses DATABASE_URL / REDIS_URL when set, else starts the embedded pair in a scratch
folder. Always works in a database of its own, heteroflow_bench, which it drops and
creates at the start and drops at the end: on a shared server, that name must be free.
Prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.busy import BusyFleet  # noqa: E402
from heteroflow.embedded import ensure_data_stores  # noqa: E402
from heteroflow.launcher import PYTHON, metrics_group_env, web_command  # noqa: E402

BENCH_DB = "heteroflow_bench"
NODE_PREFIX = "bench"
GPUS = 8
# Lock waits longer than this are written to the server log (log_lock_waits); it is
# also when PostgreSQL looks for a deadlock (default 1 s).
LOCK_WAIT_LOG_AFTER = "200ms"
LOCK_SAMPLE_SECONDS = 0.05
# a job whose mean run takes more than this share of its period is flagged
JOB_MEAN_SHARE = 0.10
# PostgreSQL's backends report their statistics (deadlocks…) at most about once a second
STATS_SETTLE_SECONDS = 1.5
LUA_SCRIPT = REPO / "bench" / "heartbeats.lua"


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


# --- the load generators --------------------------------------------------------------


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

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def beat_request(node_id: str, secret: str, body: bytes) -> bytes:
    return (
        f"POST /api/v1/nodes/{node_id}/heartbeat HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"X-API-Key: {secret}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@dataclass
class LoadResult:
    done: int
    elapsed: float
    p50: float  # seconds
    p99: float
    max: float
    errors: dict[int, int]  # status (-1: a connection error) -> count, for answers other than 200
    generator: str
    notes: list[str] = field(default_factory=list)


def from_latencies(latencies, errors, elapsed, generator, notes=()) -> LoadResult:
    return LoadResult(
        len(latencies),
        elapsed,
        percentile(latencies, 0.5),
        percentile(latencies, 0.99),
        max(latencies, default=float("nan")),
        errors,
        generator,
        list(notes),
    )


class Beats:
    """Each node's next beat request, with steady or busy readings (bench/busy.py)."""

    def __init__(self, nodes: int, secret: str, readings: str):
        self.nodes, self.secret, self.readings = nodes, secret, readings
        self.fleet = BusyFleet(NODE_PREFIX, nodes, gpus=GPUS, vary=readings == "busy", seed=28)
        # steady beats never change: build them once
        self.built = [self._build(n) for n in range(nodes)] if readings == "steady" else None

    def _build(self, n: int) -> bytes:
        return beat_request(self.fleet.node_id(n), self.secret, self.fleet.body(n))

    def next(self, n: int) -> bytes:
        return self.built[n] if self.built is not None else self._build(n)


async def send_each_once(port: int, beats: Beats, connections: int) -> tuple[float, dict[int, int]]:
    """One beat from every node, `connections` at a time: (seconds, errors)."""
    counter = itertools.count()
    errors: dict[int, int] = {}

    async def sender():
        conn = Connection(port)
        while (n := next(counter)) < beats.nodes:
            try:
                status, _ = await conn.request(beats.next(n))
            except (OSError, asyncio.IncompleteReadError):
                status = -1
                conn.close()
                conn = Connection(port)
            if status != 200:
                errors[status] = errors.get(status, 0) + 1
        conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(connections)))
    return time.perf_counter() - started, errors


async def closed_loop(port: int, beats: Beats, duration: float, connections: int) -> LoadResult:
    """Each connection sends its next beat as soon as the last was answered, cycling over
    the nodes, for `duration` seconds; latency from sending to the answer."""
    counter = itertools.count()
    latencies: list[float] = []
    errors: dict[int, int] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration

    async def sender():
        conn = Connection(port)
        while loop.time() < deadline:
            raw = beats.next(next(counter) % beats.nodes)
            started = time.perf_counter()
            try:
                status, _ = await conn.request(raw)
            except (OSError, asyncio.IncompleteReadError):
                status = -1
                conn.close()
                conn = Connection(port)
            latencies.append(time.perf_counter() - started)
            if status != 200:
                errors[status] = errors.get(status, 0) + 1
        conn.close()

    started = loop.time()
    await asyncio.gather(*(sender() for _ in range(connections)))
    return from_latencies(latencies, errors, loop.time() - started, "python (asyncio, this process)")


async def on_schedule(port: int, beats: Beats, duration: float, interval: float, connections: int) -> LoadResult:
    """Open loop: each node beats every `interval` seconds at its own phase, over a pool
    of `connections` keep-alive connections; latency from when the beat was due."""
    pool: asyncio.Queue[Connection] = asyncio.Queue()
    for _ in range(connections):
        pool.put_nowait(Connection(port))
    latencies: list[float] = []
    timeline: list[tuple[float, float]] = []  # (due, latency)
    errors: dict[int, int] = {}

    async def send(raw: bytes, due: float):
        # Latency counts from when the beat was due, so time spent waiting for a free
        # connection (queueing in the client) is in the figure too.
        conn = await pool.get()
        try:
            status, _ = await conn.request(raw)
        except (OSError, asyncio.IncompleteReadError):
            status = -1
            conn.close()
            conn = Connection(port)
        finally:
            pool.put_nowait(conn)
        latencies.append(time.perf_counter() - due)
        timeline.append((due, latencies[-1]))
        if status != 200:
            errors[status] = errors.get(status, 0) + 1

    nodes = beats.nodes
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.5
    clock_offset = time.perf_counter() - loop.time()
    tasks = []
    for k in range(int(duration / interval * nodes)):
        # each node keeps its phase: node n beats at t0 + n/nodes*interval + round*interval
        round_, n = divmod(k, nodes)
        at = t0 + (n / nodes + round_) * interval
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send(beats.next(n), due=at + clock_offset)))
    await asyncio.gather(*tasks)
    elapsed = loop.time() - t0
    start = t0 + clock_offset
    windows: dict[int, list[float]] = {}
    for due, latency in timeline:
        windows.setdefault(int((due - start) // interval), []).append(latency)
    window_p99s = ", ".join(f"{percentile(v, 0.99) * 1000:.0f}" for _, v in sorted(windows.items()))
    return from_latencies(
        latencies,
        errors,
        elapsed,
        "python (asyncio, this process)",
        [f"p99 per {interval:g} s window (ms): {window_p99s}"],
    )


def wrk_template(readings: str) -> tuple[str, list[int]]:
    """A beat body with @tokens@ where heartbeats.lua puts each beat's values, built from
    busy.py's payload so that both generators send the same shape; the cards' memory."""
    fleet = BusyFleet(NODE_PREFIX, 1, gpus=GPUS, vary=readings == "busy")
    payload = orjson.loads(fleet.body(0))
    payload.update(hostname="@host@", internal_ip="@ip@")
    if readings == "busy":
        for i, stat in enumerate(payload["gpu_stats"]):
            stat.update(memory_used_mb=f"@M{i}@", utilization=f"@U{i}@", temperature=f"@T{i}@", power_w=f"@P{i}@")
        for i, health in enumerate(payload["gpu_health"]):
            health.update(ecc_corrected_volatile=f"@C{i}@", ecc_corrected_aggregate=f"@C{i}@")
        payload.update(cpu_used="@CPU@", memory_used="@MEM@", gpu_memory_used_mb="@GMEM@")
    text = orjson.dumps(payload).decode()
    # numbers go in bare: "@M0@" -> @M0@ (the host and address stay strings)
    text = re.sub(r'"@([A-Z]+\d*)@"', r"@\1@", text)
    return text, fleet.total_mb


def run_wrk(
    port: int, secret: str, nodes: int, readings: str, duration: float, connections: int, threads: int, scratch: Path
) -> LoadResult:
    template, totals = wrk_template(readings)
    path = scratch / f"beat-{readings}.json"
    path.write_text(template)
    threads = max(1, min(threads, connections))
    command = ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(duration))}s"]
    command += ["--timeout", "30s", "-s", str(LUA_SCRIPT), f"http://127.0.0.1:{port}", "--"]
    command += [str(path), str(nodes), secret, NODE_PREFIX, "1" if readings == "busy" else "0"]
    command += [",".join(map(str, totals)), str(threads)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=duration + 120)
    line = next((x for x in result.stdout.splitlines() if x.startswith("WRKRESULT ")), None)
    if line is None:
        raise SystemExit(f"wrk printed no result (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")
    figures = orjson.loads(line.removeprefix("WRKRESULT "))
    errors = {int(status): count for status, count in figures["statuses"].items() if int(status) != 200}
    broken = sum(figures[kind] for kind in ("connect", "read", "write", "timeout"))
    if broken:
        errors[-1] = broken
    return LoadResult(
        figures["requests"],
        figures["duration_us"] / 1e6,
        figures["p50_us"] / 1e6,
        figures["p99_us"] / 1e6,
        figures["max_us"] / 1e6,
        errors,
        f"wrk ({threads} thread{'s' if threads > 1 else ''}, bench/heartbeats.lua)",
        [
            f"wrk socket errors: connect {figures['connect']}, read {figures['read']}, write {figures['write']}, "
            f"timeout {figures['timeout']}"
        ]
        if broken
        else [],
    )


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# --- what the database and the processes saw ------------------------------------------


def watch_lock_waits_in_log(admin_url: str) -> str | None:
    """Have the server log every lock wait longer than LOCK_WAIT_LOG_AFTER in the bench
    database (and look for deadlocks after as long); None when allowed, else why not."""
    import psycopg

    try:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE {BENCH_DB} SET log_lock_waits = on")
            conn.execute(f"ALTER DATABASE {BENCH_DB} SET deadlock_timeout = '{LOCK_WAIT_LOG_AFTER}'")
    except psycopg.Error as exc:
        return f"cannot set log_lock_waits ({type(exc).__name__}: {str(exc).strip()})"
    return None


class ServerLog:
    """PostgreSQL's log, read from an offset: the embedded server's file, or the file
    pg_current_logfile() names read through pg_read_file (superuser or
    pg_read_server_files); `why_not` says when neither can be read."""

    def __init__(self, admin_url: str, embedded_file: Path | None):
        self.admin_url, self.file, self.remote, self.why_not = admin_url, embedded_file, None, None
        if self.file is not None:
            return
        import psycopg

        try:
            with psycopg.connect(admin_url, autocommit=True) as conn:
                self.remote = conn.execute("SELECT pg_current_logfile()").fetchone()[0]
                if self.remote is None:
                    self.why_not = "the server's log is not a file it names (logging_collector off)"
                else:
                    conn.execute("SELECT pg_read_file(%s, 0, 1)", [self.remote])
        except psycopg.Error as exc:
            self.remote, self.why_not = None, f"the server's log cannot be read ({type(exc).__name__})"

    @property
    def readable(self) -> bool:
        return self.file is not None or self.remote is not None

    def size(self) -> int:
        if self.file is not None:
            return self.file.stat().st_size if self.file.exists() else 0
        if self.remote is None:
            return 0
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            return conn.execute("SELECT size FROM pg_stat_file(%s)", [self.remote]).fetchone()[0]

    def since(self, offset: int) -> str:
        if self.file is not None:
            with open(self.file, "rb") as handle:
                handle.seek(offset)
                return handle.read().decode(errors="replace")
        if self.remote is None:
            return ""
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            length = self.size() - offset
            if length <= 0:
                return ""
            return conn.execute("SELECT pg_read_file(%s, %s, %s)", [self.remote, offset, length]).fetchone()[0]


class LockWaitSampler(threading.Thread):
    """Every LOCK_SAMPLE_SECONDS, the bench database's sessions waiting for a lock
    (pg_stat_activity, wait_event_type 'Lock'). A wait is one (session, statement) seen
    waiting at least once, so waits shorter than the sampling interval are mostly missed."""

    def __init__(self, database_url: str):
        super().__init__(daemon=True)
        self.database_url = database_url
        self.stopping = threading.Event()
        self.samples = self.samples_waiting = self.most_at_once = 0
        self.waits: dict[tuple, str] = {}  # (pid, query_start) -> what it waited for

    def run(self):
        import psycopg

        with psycopg.connect(self.database_url, autocommit=True) as conn:
            while not self.stopping.wait(LOCK_SAMPLE_SECONDS):
                rows = conn.execute(
                    "SELECT pid, query_start, wait_event, left(regexp_replace(query, '\\s+', ' ', 'g'), 48) "
                    "FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
                ).fetchall()
                self.samples += 1
                self.samples_waiting += bool(rows)
                self.most_at_once = max(self.most_at_once, len(rows))
                for pid, query_start, wait_event, query in rows:
                    self.waits.setdefault((pid, query_start), f"{wait_event}: {query}")

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)

    def by_kind(self, top: int = 4) -> list[tuple[str, int]]:
        counts: dict[str, int] = {}
        for what in self.waits.values():
            counts[what] = counts.get(what, 0) + 1
        return sorted(counts.items(), key=lambda item: -item[1])[:top]


def deadlocks(database_url: str) -> int:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").fetchone()[0]


def job_periods(env: dict) -> dict[str, float]:
    """Every declared periodic job's period in seconds, by name."""
    code = (
        "import django, orjson, sys; django.setup(); from apps.core.guard import declared_jobs; "
        "sys.stdout.write(orjson.dumps({k: j.every for k, j in declared_jobs().items()}).decode())"
    )
    result = subprocess.run([PYTHON, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return orjson.loads(result.stdout)


def job_runs(database_url: str) -> dict[str, tuple[int, float, float]]:
    """Each guard key's (runs, total seconds, longest seconds) from its JobRun row."""
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute("SELECT key, runs, total_seconds, max_seconds FROM job_runs").fetchall()
    return {key: (runs, total, longest) for key, runs, total, longest in rows}


def forget_longest_runs(database_url: str) -> None:
    """Start each job's longest run afresh (a run under way now may still write the old one)."""
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE job_runs SET max_seconds = 0")


PROCESS_LOGS = ("web", "worker", "beat")
LOG_MARKS = ("deadlock detected", "ERROR", "Traceback")


def log_sizes(scratch: Path) -> dict[str, int]:
    return {
        name: (scratch / f"{name}.log").stat().st_size for name in PROCESS_LOGS if (scratch / f"{name}.log").exists()
    }


def log_lines_since(scratch: Path, offsets: dict[str, int]) -> dict[str, list[str]]:
    lines = {}
    for name, offset in offsets.items():
        with open(scratch / f"{name}.log", "rb") as handle:
            handle.seek(offset)
            lines[name] = handle.read().decode(errors="replace").splitlines()
    return lines


# a traceback's last line: the exception raised (`psycopg.errors.DeadlockDetected: …`)
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Timeout|Detected)\b")


def say_log_marks(lines: dict[str, list[str]], indent: str = "  ") -> None:
    """Per log: the lines with each mark, the commonest exceptions raised, the first ERROR."""
    for name, text in lines.items():
        counts = ", ".join(f"{sum(mark in line for line in text)} {mark!r}" for mark in LOG_MARKS)
        say(f"{indent}{name + ' log':<20} {counts}")
        raised: dict[str, int] = {}
        for line in text:
            if EXCEPTION_LINE.match(line):
                raised[line.strip()[:140]] = raised.get(line.strip()[:140], 0) + 1
        for line, count in sorted(raised.items(), key=lambda item: -item[1])[:3]:
            say(f"{indent}    {count}× {line}")
        first = next((line.strip()[:160] for line in text if "ERROR" in line), None)
        if first:
            say(f"{indent}    first ERROR: {first}")


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min) on {os.cpu_count()} cores"


def table_counters(database_url: str) -> dict:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        commits = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()[0]
        rows = dict(
            conn.execute(
                "SELECT relname, n_tup_upd + n_tup_ins FROM pg_stat_user_tables "
                "WHERE relname IN ('nodes', 'gpus', 'alerts') OR relname LIKE 'node_metrics_%'"
            ).fetchall()
        )
    rows["node_metrics"] = sum(v for k, v in rows.items() if k.startswith("node_metrics_"))
    return {
        "commits": commits,
        "nodes": rows.get("nodes", 0),
        "gpus": rows.get("gpus", 0),
        "node_metrics": rows["node_metrics"],
        "alerts": rows.get("alerts", 0),
    }


def statements_per_steady_beat(env: dict) -> list[str]:
    """One more steady beat, in this process, through the same ingest code, counting
    what it sends to PostgreSQL."""
    code = r"""
import asyncio, orjson, psycopg, django
django.setup()
from apps.core.clock import utcnow
from apps.core.db import libpq_params
from apps.nodes import heartbeat
from bench.busy import BusyFleet
from bench.heartbeats import GPUS, NODE_PREFIX
seen = []
original = psycopg.AsyncCursor.execute
async def counting(cursor, query, params=None, **kw):
    seen.append(str(query).split()[0].upper())
    return await original(cursor, query, params, **kw)
psycopg.AsyncCursor.execute = counting
async def main():
    async with await psycopg.AsyncConnection.connect(**libpq_params(autocommit=True)) as conn:
        fleet = BusyFleet(NODE_PREFIX, 1, gpus=GPUS, vary=False)
        await heartbeat.ingest(conn, fleet.node_id(0), orjson.loads(fleet.body(0)), "127.0.0.1", utcnow())
asyncio.run(main())
print(" ".join(seen))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return result.stdout.split()


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


@dataclass
class Watch:
    """What the run is measured against besides the load: the database, the jobs, the logs."""

    database_url: str
    scratch: Path
    server_log: ServerLog
    log_lock_waits: str | None  # None: waits over LOCK_WAIT_LOG_AFTER are logged; else why not
    periods: dict[str, float] | None  # None: no worker and beat running


def run_scenario(args, port: int, secret: str, watch: Watch, readings: str, beats: Beats) -> None:
    database_url = watch.database_url
    if readings != "steady":
        # the first beat in a new shape (health counters…) may take the slow path: unmeasured
        seconds, errors = asyncio.run(send_each_once(port, beats, args.connections))
        say(f"  one unmeasured {readings} beat per node first: {seconds:.1f} s, {sum(errors.values())} not 200")
    if args.warmup > 0:
        # what a fleet does once (the first drift marks and alerts a beat raises after
        # HETEROFLOW_GPU_MEMORY_DRIFT_BEATS beats, a health reading's first samples) is
        # not the steady state the figures are about: run it off the clock
        warm = asyncio.run(closed_loop(port, beats, args.warmup, args.connections))
        failed = sum(warm.errors.values())
        say(f"  unmeasured warm-up: {args.warmup:g} s closed loop, {warm.done} beats, {failed} not 200")
    say(f"  load average before: {load_average()}")
    if watch.periods is not None:
        forget_longest_runs(database_url)
    jobs_before = job_runs(database_url) if watch.periods is not None else {}
    counters_before = table_counters(database_url)
    deadlocks_before = deadlocks(database_url)
    server_log_from = watch.server_log.size()
    process_logs_from = log_sizes(watch.scratch)
    sampler = LockWaitSampler(database_url)
    sampler.start()
    try:
        if args.mode == "schedule":
            result = asyncio.run(on_schedule(port, beats, args.duration, args.interval, args.connections))
        elif args.generator == "wrk":
            result = run_wrk(
                port, secret, args.nodes, readings, args.duration, args.connections, args.wrk_threads, watch.scratch
            )
        else:
            result = asyncio.run(closed_loop(port, beats, args.duration, args.connections))
    finally:
        sampler.stop()
    load_after = load_average()
    time.sleep(STATS_SETTLE_SECONDS)
    deadlocks_after = deadlocks(database_url)
    counters_after = table_counters(database_url)
    server_log = watch.server_log.since(server_log_from)
    jobs_after = job_runs(database_url) if watch.periods is not None else {}

    say(f"\n== heartbeats: {readings} readings, {args.mode} ==")
    say(f"  generator            {result.generator}")
    offered = f" (offered {args.nodes / args.interval:.0f}/s)" if args.mode == "schedule" else ""
    say(
        f"  heartbeats           {result.done} in {result.elapsed:.1f} s = "
        f"{result.done / result.elapsed:.0f}/s{offered}"
    )
    say(
        f"  latency              p50 {result.p50 * 1000:.1f} ms, p99 {result.p99 * 1000:.1f} ms, "
        f"max {result.max * 1000:.1f} ms"
    )
    say(f"  not 200              {sum(result.errors.values())} {result.errors or ''}")
    for note in result.notes:
        say(f"  {note}")
    done = max(result.done, 1)
    commits = counters_after["commits"] - counters_before["commits"]
    say(
        f"  per heartbeat        {commits / done:.2f} commits{' (the jobs’ too)' if watch.periods else ''}, "
        f"{(counters_after['nodes'] - counters_before['nodes']) / done:.2f} node rows, "
        f"{(counters_after['gpus'] - counters_before['gpus']) / done:.2f} GPU rows, "
        f"{(counters_after['node_metrics'] - counters_before['node_metrics']) / done:.2f} metric rows"
    )
    alert_rows = counters_after["alerts"] - counters_before["alerts"]
    say(f"  alert rows written   {alert_rows} ({alert_rows / max(result.elapsed, 1e-9):.1f}/s: raised and recovered)")
    say(
        f"  deadlocks            {deadlocks_after - deadlocks_before} "
        f"(pg_stat_database.deadlocks: {deadlocks_before} before, {deadlocks_after} after)"
    )
    kinds = ", ".join(f"{count}× {what}" for what, count in sampler.by_kind())
    say(
        f"  lock waits (sampled) {len(sampler.waits)} seen waiting in {sampler.samples_waiting} of {sampler.samples} "
        f"samples of pg_stat_activity every {LOCK_SAMPLE_SECONDS * 1000:.0f} ms, at most {sampler.most_at_once} at once"
    )
    if kinds:
        say(f"                       most: {kinds}")
    if watch.log_lock_waits is None and watch.server_log.readable:
        waited = server_log.count("still waiting for")
        logged_deadlocks = server_log.count("deadlock detected")
        say(
            f"  lock waits (logged)  {waited} over {LOCK_WAIT_LOG_AFTER} (log_lock_waits), "
            f"{logged_deadlocks} 'deadlock detected' in the server log"
        )
    else:
        say(f"  lock waits (logged)  not counted: {watch.log_lock_waits or watch.server_log.why_not}")
    if watch.periods is not None:
        say_jobs(watch.periods, jobs_before, jobs_after, result.elapsed)
    say("  process logs during the run:")
    say_log_marks(log_lines_since(watch.scratch, process_logs_from), indent="    ")
    say(f"  load average after:  {load_after}")


def say_jobs(periods: dict[str, float], before: dict, after: dict, elapsed: float) -> None:
    say(
        f"  periodic jobs        runs in this run, mean / max run time (JobRun), period; "
        f"* mean over {JOB_MEAN_SHARE:.0%} of the period"
    )
    # a per-host job's key is `name@host` (apps.core.guard.per_host_key)
    ran = {key.split("@", 1)[0] for key in after}
    idle = [
        f"{name} (every {period:g} s)"
        for name, period in sorted(periods.items())
        if period <= elapsed and name not in ran
    ]
    for key in sorted(after):
        period = periods.get(key.split("@", 1)[0])
        runs0, total0, _ = before.get(key, (0, 0.0, 0.0))
        runs1, total1, longest = after[key]
        runs = runs1 - runs0
        if not runs:
            if period is not None and period <= elapsed:
                idle.append(f"{key} (every {period:g} s)")
            continue
        mean = (total1 - total0) / runs
        flag = "*" if period and mean > JOB_MEAN_SHARE * period else " "
        due = f"~{elapsed / period:.0f} due), every {period:g} s" if period else "period unknown)"
        say(f"   {flag} {key:<40} {runs:>4} runs, mean {mean * 1000:8.1f} ms, max {longest * 1000:8.1f} ms ({due}")
    if idle:
        say(f"    due but not run: {', '.join(idle)}")
    longer = sorted(name for name, period in periods.items() if period > elapsed and name not in ran)
    if longer:
        say(f"    not due in {elapsed:.0f} s (longer periods): {len(longer)} jobs")


def start_server(env: dict, workers: int, *extra: str, log: Path | None = None) -> tuple[subprocess.Popen, int]:
    """The control plane's web process as `make up` starts it, with `workers` processes,
    on a free port; returns once /health answers. `log`: a file for its output."""
    port = free_port()
    output = open(log, "ab") if log else None
    server = subprocess.Popen(
        web_command("127.0.0.1", port, "--workers", str(workers), "--no-access-log", *extra, "--log-level", "warning"),
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=output,
        stderr=subprocess.STDOUT if output else None,
    )
    wait_for(f"http://127.0.0.1:{port}/health")
    return server, port


def start_jobs(env: dict, scratch: Path) -> list[subprocess.Popen]:
    """A Celery worker and beat as `make up` starts them (heteroflow/launcher.py), so every
    periodic job runs on its period; their output in scratch/worker.log and beat.log."""
    celery = [PYTHON, "-m", "celery", "-A", "celery_worker"]
    commands = {
        "worker": celery + ["worker", "--loglevel", "INFO", "--concurrency", "2"],
        "beat": celery + ["beat", "--loglevel", "INFO", "--schedule", str(scratch / "celerybeat-schedule")],
    }
    started = []
    for name, command in commands.items():
        with open(scratch / f"{name}.log", "ab") as log:
            started.append(
                subprocess.Popen(
                    command,
                    cwd=REPO,
                    env=metrics_group_env(env, scratch, name),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return started


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def stores_in_use(stores) -> str:
    return ", ".join(stores.embedded) + " embedded" if stores.embedded else "from DATABASE_URL / REDIS_URL"


def run_heartbeats(args, port: int, secret: str, watch: Watch, env: dict) -> None:
    registration = Beats(args.nodes, secret, "steady")
    say(f"registering {args.nodes} nodes ({args.connections} at a time; first beats take the slow path)…")
    seconds, errors = asyncio.run(send_each_once(port, registration, args.connections))
    say(
        f"  registered in {seconds:.1f} s = {args.nodes / seconds:.0f}/s, {sum(errors.values())} not 200 {errors or ''}"
    )
    statements = statements_per_steady_beat(env)
    say(
        f"  statements per steady-state beat: {len(statements)} "
        f"({' + '.join(statements)}: node UPDATE + GPU UPDATE + metrics INSERT as one statement)"
    )
    kinds = ("steady", "busy") if args.readings == "both" else (args.readings,)
    for readings in kinds:
        what = (
            f"{args.nodes} nodes every {args.interval:g} s (offered {args.nodes / args.interval:.0f}/s)"
            if args.mode == "schedule"
            else f"{args.connections} connections closed loop over {args.nodes} nodes"
        )
        say(f"\n{readings} readings: {what} for {args.duration:g} s…")
        beats = registration if readings == "steady" else Beats(args.nodes, secret, readings)
        run_scenario(args, port, secret, watch, readings, beats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between a node's beats (schedule mode)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--mode", choices=("schedule", "closed"), default="schedule")
    parser.add_argument("--readings", choices=("steady", "busy", "both"), default="both")
    parser.add_argument(
        "--warmup", type=float, default=20.0, help="seconds of unmeasured closed-loop beats before each measured run"
    )
    parser.add_argument(
        "--generator", choices=("python", "wrk"), default="python", help="closed mode: who sends the beats"
    )
    parser.add_argument("--wrk-threads", type=int, default=1)
    parser.add_argument(
        "--jobs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run a Celery worker and beat (every periodic job on its period) during the load",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the scratch folder (process and server logs)")
    parser.add_argument("--skip-list", action="store_true", help="skip the node-list and health-check parts")
    parser.add_argument("--list-only", action="store_true", help="only the node-list and health-check parts")
    args = parser.parse_args()
    if args.generator == "wrk":
        if args.mode != "closed":
            parser.error("--generator wrk sends closed loop only: add --mode closed")
        if shutil.which("wrk") is None:
            parser.error("--generator wrk needs wrk on the PATH (Debian/Ubuntu: apt-get install wrk)")

    scratch = Path(tempfile.mkdtemp(prefix="hf-bench-"))
    (scratch / "static").mkdir()  # production serves collected static files from here
    stores = ensure_data_stores(scratch, os.environ)
    admin_url = stores.database_url
    recreate_database(admin_url)
    database_url = with_database(admin_url, BENCH_DB)
    log_lock_waits = watch_lock_waits_in_log(admin_url)
    # the embedded server (pgserver) writes its log to postgres/log in its data folder
    server_log = ServerLog(admin_url, scratch / "postgres" / "log" if "PostgreSQL" in stores.embedded else None)
    secret = secrets.token_urlsafe(24)
    env = server_env(database_url, stores.redis_url, scratch, secret)
    server, jobs = None, []
    try:
        subprocess.run(
            [sys.executable, "manage.py", "migrate_schemas", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True
        )
        server, port = start_server(
            env, args.workers, "--loop", "uvloop", "--http", "httptools", log=scratch / "web.log"
        )
        periods = None
        if args.jobs and not args.list_only:
            jobs = start_jobs(env, scratch)
            periods = job_periods(env)
        where = stores_in_use(stores)
        say(
            f"server: uvicorn, {args.workers} workers, production settings; "
            f"Celery worker (2 processes) and beat: {'running every periodic job' if jobs else 'not started'}; "
            f"data stores: {where}; machine: {os.cpu_count()} cores"
        )
        say(
            f"load generator: {args.generator if args.mode == 'closed' else 'python'}, {args.mode} mode; "
            f"lock waits: sampled from pg_stat_activity every {LOCK_SAMPLE_SECONDS * 1000:.0f} ms"
            + (
                f" and logged by the server over {LOCK_WAIT_LOG_AFTER} "
                f"(log_lock_waits; deadlock_timeout {LOCK_WAIT_LOG_AFTER})"
                if log_lock_waits is None and server_log.readable
                else f"; not from the server log: {log_lock_waits or server_log.why_not}"
            )
        )

        if not args.list_only:
            watch = Watch(database_url, scratch, server_log, log_lock_waits, periods)
            run_heartbeats(args, port, secret, watch, env)
            say("\n== process logs, whole run (registration included) ==")
            say_log_marks(log_lines_since(scratch, dict.fromkeys(log_sizes(scratch), 0)))
            if jobs:
                stop(jobs)
                jobs = []
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
        stop(jobs + ([server] if server is not None else []))
        drop_database(admin_url)
        stores.stop()
        if args.keep_logs:
            say(f"\nlogs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
