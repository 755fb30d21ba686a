"""Live logs under load (issue 30): ingestion, the heartbeat beside it, print-to-screen
latency and many followers, against the control plane as `make up` runs it.

    make bench-logs
    make bench-logs BENCH_ARGS="--duration 30 --followers 50"
    .venv/bin/python bench/logs.py --skip-heartbeats --skip-followers --rate 40

What runs, with production settings: the web process (uvicorn, --workers processes,
started as bench/heartbeats.py starts it), a Celery worker (--concurrency 2) and Celery
beat, so every periodic job runs on its period alongside the load. Uses DATABASE_URL /
REDIS_URL when set, else an embedded pair in a scratch folder; works in a database of its
own, heteroflow_bench_logs, dropped before and after (on a shared server that name must
be free), and numbers its tasks from 7,000,000,000 and up, since a follower's Redis
channel is named by task id alone and Redis's channels span its databases: with low ids,
a test run on the same Redis server would feed this bench's followers and be fed by it
(give it a Redis database of its own too, or its Celery worker takes the tests' jobs).
The parts, in the order they run:

- print-to-screen: a real agent (`python -m heteroflow_agent`, the process runtime) runs
  a task created through the API that prints `TS <time.time()>` every 50 ms for
  --print-seconds (30); `hf logs ID -f` follows it as a subprocess, and each line it prints
  is timed against the time in it: p50 / p99 / max, and where the time goes (written to
  read by the agent, read to stored, stored to printed), from the stored lines' `at` and
  `received_at`. Runs first, on a quiet fleet, so that the scheduler has only the
  agent's node to place the task on.
- ingestion: --log-nodes simulated agents, each with --tasks / --log-nodes running
  tasks (rows written at set-up; the nodes beat every 5 s all along, so the failure
  policy leaves their tasks alone), shipping --rate MB/s of log text in all as agents do
  (bench/logload.py: one gzip batch a second per node, bursty tasks, lines of 20-300
  characters, all prepared before the clock starts in a process of its own); prints
  MB/s, lines/s, batches/s, batch latency and the non-2xx answers.
- heartbeats with and without logs: bench/heartbeats.py's busy fleet (--hb-nodes every
  --hb-interval s, its own code) alone, then the same together with the ingestion load
  (at --hb-rate MB/s; default --rate); both p99s and their ratio.
- followers: --followers clients follow one chatty task (--chatty-lines lines a second,
  shipped every --ship-seconds) over `GET /api/v1/tasks/{id}/logs?follow=true`; each
  checks its sequence numbers for gaps and repeats; at the end each one's lag (the last
  line stored minus the last it got) and the lines delivered a second in all.

Beside each part: PostgreSQL's deadlocks (pg_stat_database) before and after, the cores
each process group used (to tell a slow server from a machine shared with other work),
and at the end each periodic job's runs and mean / max run time (JobRun) over the whole
run and the error lines in the processes' logs. Prints figures; it asserts nothing (the
targets are printed beside the figures, met or missed).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import http.client
import json
import multiprocessing
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import logload  # noqa: E402
from bench.busy import BusyFleet  # noqa: E402
from bench.heartbeats import (  # noqa: E402
    Beats,
    deadlocks,
    drop_database,
    forget_longest_runs,
    job_periods,
    job_runs,
    load_average,
    log_lines_since,
    log_sizes,
    on_schedule,
    percentile,
    recreate_database,
    say_jobs,
    say_log_marks,
    send_each_once,
    server_env,
    start_jobs,
    start_server,
    stop,
    stores_in_use,
)
from bench.soak import Conn  # noqa: E402
from heteroflow.embedded import ensure_data_stores  # noqa: E402
from heteroflow.launcher import metrics_group_env  # noqa: E402

DB_NAME = "heteroflow_bench_logs"
LOG_PREFIX = "logs"  # the simulated log-shipping nodes (the heartbeat fleet's are "bench")
AGENT_NODE = "bench-agent"  # the real agent's node id
RUN = "r1"
TARGET_MB_S = 20.0
TARGET_HB_RATIO = 1.20
TARGET_SCREEN_P99 = 1.0
PRINT_EVERY = 0.05  # the printing task's period, seconds
TASK_IDS_FROM = 7_000_000_000  # the bench's task ids start at this plus a random offset (SETUP)
LAG_GRACE_SECONDS = 3.0  # after the chatty task's last batch, before the followers' lag is read

SETUP = r"""
import json, secrets, sys, django
django.setup()
from django.contrib.auth import get_user_model
from apps.core.principals import Principal, PrincipalKind
from apps.scheduler.services import set_plugin_options
from apps.tenants import services
from apps.tenants.choices import Role
tenant = services.create_tenant(name="Logs", slug="logs", max_concurrent_tasks=10_000_000, max_gpus=10_000_000)
services.add_member(tenant, username="logs-member", role=Role.MEMBER, password=secrets.token_urlsafe(16))
user = get_user_model().objects.get(username="logs-member")
owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=Role.MEMBER)
key = services.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name="bench-logs").key
# Task ids far from where a fresh database starts: a follower is fed on the Redis channel
# heteroflow:task-logs:<task id>, and channels are one namespace for every database of a
# Redis server, so a test run (or a second bench) on the same Redis with task 1, 2, …
# would feed our followers its lines, and ours its
from django.db import connection
with connection.cursor() as cursor:
    cursor.execute("SELECT setval(pg_get_serial_sequence('tasks', 'id'), %s)", [int(sys.argv[1])])
# the machine runs the load generators too: its CPU reading must not keep the task waiting
set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
print(json.dumps({"key": key, "tenant": tenant.pk}))
"""

# running tasks written as a bind and a claim leave them (no card: gpu_required 0)
TASKS = r"""
import json, sys, django
django.setup()
from apps.core.clock import utcnow
from apps.tasks.models import Task
spec = json.loads(sys.argv[1])
now = utcnow()
rows = [
    Task(tenant_id=spec["tenant"], name=f"{node}-{i}", image="x", command=["train"], status="running",
         node_id=node, gpu_required=0, started_at=now)
    for node, count in spec["nodes"].items() for i in range(count)
]
Task.objects.bulk_create(rows, batch_size=1000)
out = {}
for task in rows:
    out.setdefault(task.node_id, []).append(task.pk)
print(json.dumps(out))
"""

ONLINE = "SELECT 1 FROM nodes WHERE id = %s AND status = 'online'"
PRINTER = """
import time
end = time.time() + {seconds}
while time.time() < end:
    print("TS %.6f" % time.time(), flush=True)
    time.sleep({every})
"""


def say(message: str) -> None:
    print(message, flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds == seconds else "n/a"


def django_script(env: dict, code: str, *argv: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        raise SystemExit(f"set-up script failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def query(database_url: str, sql: str, params=()) -> list[tuple]:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


# --- where the CPU went -----------------------------------------------------------------


def tree_cpu(pid: int, recursive: bool = True) -> dict[int, float]:
    """CPU seconds so far of the process and (with `recursive`) its descendants, by pid."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)] if recursive else [root]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for process in family:
        try:
            times = process.cpu_times()
            out[process.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return out


def cpu_snapshot(pids: dict[str, list[int]]) -> dict:
    """CPU seconds so far, by pid, of each group (a pid's whole tree; "bench": this process
    alone, its children are groups of their own), of every postgres and redis-server
    process of the machine, and the machine's busy time in all."""
    import psutil

    out: dict = {}
    for name, group in pids.items():
        out[name] = {}
        for pid in group:
            out[name] |= tree_cpu(pid, recursive=name != "bench")
    out["postgres"], out["redis"] = {}, {}
    for process in psutil.process_iter(["name", "cpu_times"]):
        name, times = process.info["name"] or "", process.info["cpu_times"]
        if times is None:
            continue
        if name.startswith("postgres"):
            out["postgres"][process.pid] = times.user + times.system
        elif name.startswith("redis-server"):
            out["redis"][process.pid] = times.user + times.system
    machine = psutil.cpu_times()
    out["machine"] = sum(
        getattr(machine, part, 0.0) for part in ("user", "nice", "system", "irq", "softirq", "steal", "guest")
    )
    out["at"] = time.monotonic()
    return out


def cpu_line(before: dict, after: dict) -> str:
    """Cores each group used between two snapshots (a process that ended in between is
    not counted: its share is in "other")."""
    seconds = max(after["at"] - before["at"], 1e-6)
    used = {
        name: sum(cpu - before.get(name, {}).get(pid, 0.0) for pid, cpu in group.items()) / seconds
        for name, group in after.items()
        if name not in ("machine", "at")
    }
    machine = (after["machine"] - before["machine"]) / seconds
    parts = ", ".join(f"{name} {value:.2f}" for name, value in used.items())
    return (
        f"cores busy {machine:.2f} of {os.cpu_count()}: {parts}, "
        f"other processes {max(0.0, machine - sum(used.values())):.2f}"
    )


# --- the simulated log nodes' own heartbeats ---------------------------------------------


class KeepAlive(threading.Thread):
    """The log nodes beat every `interval` seconds, each at its own phase, all along (a
    node silent for 45 s would be given up and its tasks requeued). Their beats omit
    live_task_ids, as agents without an executor do, so the stalled-task check leaves
    the tasks written at set-up alone."""

    def __init__(self, port: int, secret: str, nodes: int, interval: float = 5.0):
        super().__init__(daemon=True)
        self.port, self.secret, self.interval = port, secret, interval
        self.fleet = BusyFleet(LOG_PREFIX, nodes, seed=30)
        self.stopping = threading.Event()
        self.sent = 0
        self.failed: dict[int, int] = {}

    def beat(self, conn: http.client.HTTPConnection, n: int) -> http.client.HTTPConnection:
        try:
            conn.request(
                "POST",
                f"/api/v1/nodes/{self.fleet.node_id(n)}/heartbeat",
                self.fleet.body(n),
                {"X-API-Key": self.secret, "Content-Type": "application/json"},
            )
            response = conn.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            status = -1
        self.sent += 1
        if status != 200:
            self.failed[status] = self.failed.get(status, 0) + 1
        return conn

    def register(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        for n in range(self.fleet.nodes):
            conn = self.beat(conn, n)
        conn.close()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        gap = self.interval / self.fleet.nodes
        n = 0
        while not self.stopping.wait(gap):
            conn = self.beat(conn, n)
            n = (n + 1) % self.fleet.nodes
        conn.close()

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=35)


# --- the ingestion generator (bench/logload.py, in a process of its own) ------------------


class Generator:
    """The ingestion load's process: prepared batches, sent on "go"."""

    def __init__(self, spec: dict):
        context = multiprocessing.get_context("spawn")
        self.pipe, child = context.Pipe()
        self.process = context.Process(target=logload.run_child, args=(child, spec), daemon=True)
        self.process.start()
        child.close()

    def expect(self, what: str, timeout: float) -> dict:
        if not self.pipe.poll(timeout):
            raise SystemExit(f"the ingestion generator said nothing for {timeout:.0f} s (waiting for {what!r})")
        kind, payload = self.pipe.recv()
        if kind != what:
            raise SystemExit(f"the ingestion generator: {kind}: {payload}")
        return payload

    def go(self) -> None:
        self.pipe.send("go")

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(timeout=10)


def ingest_spec(args, world: World, rate: float, seconds: int, seed: int) -> dict:
    return {
        "repo": str(REPO),
        "port": world.port,
        "secret": world.secret,
        "nodes": world.log_tasks,
        "run": RUN,
        "next_n": dict(world.next_n),
        "rate_bytes": rate * 1e6,
        "seconds": seconds,
        "warmup": args.ingest_warmup,
        "duration": args.duration,
        "gzip_level": args.gzip_level,
        "seed": seed,
        "start_in": 8.0,  # about when the batches go: what their lines' `at` say
    }


def prepared_line(ready: dict) -> str:
    return (
        f"prepared {ready['text_bytes'] / 1e6:.0f} MB of log text in {ready['build_seconds']:.1f} s "
        f"(gzip {ready['compressed'] / 1e6:.0f} MB, {ready['text_bytes'] / max(ready['compressed'], 1):.1f}:1)"
    )


def say_ingestion(result: dict, args, rate: float, indent: str = "  ") -> float:
    seconds = result["duration"]
    mb_s = result["bytes"] / seconds / 1e6
    say(
        f"{indent}offered              {rate:g} MB/s of log text: {args.log_nodes} nodes × "
        f"{args.tasks // args.log_nodes} tasks, one batch a second per node ({result['due']} batches due "
        f"in {seconds:g} s)"
    )
    say(
        f"{indent}stored               {mb_s:.2f} MB/s of text ({result['compressed'] / seconds / 1e6:.2f} MB/s gzip), "
        f"{result['lines'] / seconds:,.0f} lines/s, {result['batches'] / seconds:.1f} batches/s "
        f"({result['lines'] / max(result['batches'], 1):.0f} lines, "
        f"{result['bytes'] / max(result['batches'], 1) / 1024:.0f} KB of text a batch)"
    )
    say(
        f"{indent}batch latency        p50 {ms(result['p50'])}, p99 {ms(result['p99'])}, max {ms(result['max'])} "
        f"(sent to answered)"
    )
    say(
        f"{indent}behind schedule      answer − due p50 {ms(result['lag_p50'])}, p99 {ms(result['lag_p99'])}; "
        f"{result['unsent']} of {result['due']} batches due not sent by the end (the nodes' backlog)"
    )
    errors = sum(result["errors"].values())
    say(
        f"{indent}non-2xx              {errors} {result['errors'] or ''}"
        + (f"; refused tasks: {result['refused'][:10]}" if result["refused"] else "")
    )
    say(
        f"{indent}generator            {result['cpu_seconds'] / seconds:.2f} cores (its own process, "
        "batches prepared before the clock)"
    )
    return mb_s


# --- the world the parts share ------------------------------------------------------------


@dataclass
class World:
    database_url: str
    env: dict
    port: int
    secret: str
    key: str = ""
    tenant: int = 0
    log_tasks: dict[str, list[int]] = field(default_factory=dict)
    next_n: dict[int, int] = field(default_factory=dict)
    chatty: tuple[str, int] | None = None  # (node, task)
    pids: dict[str, list[int]] = field(default_factory=dict)
    verdicts: list[tuple[str, bool | None, str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Part:
    """A part's deadlocks and cores, printed after its figures."""

    def __init__(self, world: World, title: str):
        self.world, self.title = world, title

    def __enter__(self):
        say(f"\n== {self.title} ==")
        self.deadlocks = deadlocks(self.world.database_url)
        return self

    def window(self) -> None:
        self.cpu_before = cpu_snapshot(self.world.pids)

    def window_end(self) -> None:
        self.cpu_after = cpu_snapshot(self.world.pids)

    def __exit__(self, kind, value, tb):
        if kind is not None:
            return False
        time.sleep(1.5)  # PostgreSQL reports a backend's counters about once a second
        after = deadlocks(self.world.database_url)
        if getattr(self, "cpu_after", None):
            say(f"  cpu                  {cpu_line(self.cpu_before, self.cpu_after)}")
        say(
            f"  deadlocks            {after - self.deadlocks} "
            f"(pg_stat_database: {self.deadlocks} before, {after} after)"
        )
        say(f"  load average         {load_average()}")
        return False


def settle(world: World) -> None:
    """What a burst of log lines leaves PostgreSQL to do (autovacuum and analyze of the
    lines just inserted, a checkpoint of their WAL) done now, off the clock, so that the
    next part's baseline does not pay for the last part's load."""
    import psycopg

    started = time.perf_counter()
    try:
        with psycopg.connect(world.database_url, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE) task_log_chunks")
            conn.execute("CHECKPOINT")
        took = time.perf_counter() - started
        say(f"  settled              VACUUM (ANALYZE) task_log_chunks and CHECKPOINT, off the clock: {took:.1f} s")
    except psycopg.Error as exc:
        say(f"  settled              not: {type(exc).__name__}: {str(exc).strip()[:120]}")


# --- part: print-to-screen latency ---------------------------------------------------------


def start_agent(world: World, data_dir: Path, ship_seconds: float) -> subprocess.Popen:
    """A real agent (as tests/live.py starts one): the process runtime, this server."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")}
    inherited.pop("DOCKER_HOST", None)  # plain processes, even where an engine answers
    data_dir.mkdir(parents=True)
    env = inherited | {
        "HETEROFLOW_SERVER_URL": world.url,
        "HETEROFLOW_AGENT_KEY": world.secret,
        "HETEROFLOW_AGENT_DATA_DIR": str(data_dir),
        "HETEROFLOW_NODE_ID": AGENT_NODE,
        "HETEROFLOW_HEARTBEAT_INTERVAL": "5",
        "HETEROFLOW_MODEL_SCAN_DIRS": str(data_dir / "models"),
        "HETEROFLOW_ALLOW_PROCESS_RUNTIME": "true",
        "HETEROFLOW_PROCESS_RUN_AS_ROOT": "true",  # where the bench runs as root: its tasks are its own
        "HETEROFLOW_LOG_SHIP_SECONDS": f"{ship_seconds:g}",
    }
    with open(data_dir.with_name("agent.log"), "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "heteroflow_agent"],
            cwd=REPO,
            env=env,
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def api(world: World, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", world.port, timeout=30)
    try:
        conn.request(
            method,
            path,
            orjson.dumps(body) if body is not None else None,
            {"Authorization": f"Bearer {world.key}", "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        return response.status, orjson.loads(response.read() or b"{}")
    finally:
        conn.close()


def print_to_screen(args, world: World, scratch: Path) -> None:
    with Part(world, "print-to-screen: a real task's line to the same line printed by `hf logs -f`") as part:
        agent = start_agent(world, scratch / "agent" / "data", args.ship_seconds)
        world.pids["agent, hf"] = [agent.pid]
        hf = None
        try:
            wait_until(
                lambda: query(world.database_url, ONLINE, [AGENT_NODE]),
                60,
                "the agent's node to come online",
            )
            code = PRINTER.format(seconds=args.print_seconds, every=PRINT_EVERY)
            command = [sys.executable, "-u", "-c", code]
            spec = {"name": "ts-printer", "image": "busybox", "gpu_required": 0, "command": command}
            status, task = api(world, "POST", "/api/v1/tasks", spec)
            if status != 201:
                raise SystemExit(f"creating the printing task answered {status}: {task}")
            task_id = task["id"]
            home = scratch / "hf-home"
            home.mkdir()
            env = {k: v for k, v in os.environ.items() if not k.startswith(("HETEROFLOW_", "XDG_"))} | {
                "HOME": str(home),
                "XDG_CONFIG_HOME": str(home / "cfg"),
                "XDG_CACHE_HOME": str(home / "cache"),
                "HETEROFLOW_URL": world.url,
                "HETEROFLOW_API_KEY": world.key,
                "PYTHONUNBUFFERED": "1",
            }
            created = time.time()
            hf = subprocess.Popen(
                [str(Path(sys.executable).with_name("hf")), "logs", str(task_id), "-f"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            world.pids["agent, hf"].append(hf.pid)
            printed: list[tuple[float, str]] = []  # (when hf printed it, the line)
            first = threading.Event()

            def read():
                for raw in hf.stdout:
                    now = time.time()
                    line = raw.decode(errors="replace").rstrip("\n")
                    if line.startswith("TS "):
                        printed.append((now, line))
                        first.set()

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            if not first.wait(90):
                raise SystemExit(f"hf printed no line in 90 s; its stderr: {hf.stderr.read1(4000)!r}")
            started = printed[0][0]
            part.window()
            try:
                hf.wait(timeout=args.print_seconds + 90)
            except subprocess.TimeoutExpired:
                raise SystemExit("hf logs -f did not end within the task's time + 90 s") from None
            part.window_end()
            reader.join(timeout=10)
            errors = hf.stderr.read().decode(errors="replace").strip()
        finally:
            if hf is not None and hf.poll() is None:
                os.killpg(hf.pid, signal.SIGTERM)
            stop([agent])
            world.pids.pop("agent, hf", None)

        latencies = [when - float(line.split()[1]) for when, line in printed]
        stored = {
            text: (at, received)
            for text, at, received in query(
                world.database_url,
                "SELECT e.line->>3, (e.line->>1)::float8, extract(epoch FROM c.received_at)::float8 "
                "FROM task_log_chunks AS c CROSS JOIN LATERAL json_array_elements(c.lines::json) AS e(line) "
                "WHERE c.task_id = %s",
                [task_id],
            )
        }
        read_delay, store_delay, show_delay = [], [], []
        for when, line in printed:
            if line in stored:
                at, received = stored[line]
                written = float(line.split()[1])
                read_delay.append(at - written)
                store_delay.append(received - at)
                show_delay.append(when - received)
        expected = int(args.print_seconds / PRINT_EVERY)
        p99 = percentile(latencies, 0.99)
        row = query(world.database_url, "SELECT status, exit_code FROM tasks WHERE id = %s", [task_id])[0]
        say(
            f"  task                 #{task_id} on {AGENT_NODE} (process runtime), {row[0]} with exit code {row[1]}; "
            f"first line printed {started - created:.1f} s after the create"
        )
        say(
            f"  lines                {len(printed)} printed by hf (about {expected} written; "
            f"{len(set(line for _, line in printed))} distinct), stored {len(stored)}; hf's stderr: {errors[:200]!r}"
        )
        say(
            f"  written → printed    p50 {ms(percentile(latencies, 0.5))}, p99 {ms(p99)}, "
            f"max {ms(max(latencies, default=float('nan')))}"
        )
        say(
            f"  where it goes (p50 / p99): written → read by the agent {ms(percentile(read_delay, 0.5))} / "
            f"{ms(percentile(read_delay, 0.99))}; read → stored {ms(percentile(store_delay, 0.5))} / "
            f"{ms(percentile(store_delay, 0.99))}; stored → printed {ms(percentile(show_delay, 0.5))} / "
            f"{ms(percentile(show_delay, 0.99))}"
        )
        say(f"  (the agent ships every {args.ship_seconds:g} s: log_ship_seconds)")
        met = p99 <= TARGET_SCREEN_P99
        world.verdicts.append(("print-to-screen p99 <= 1 s", met, f"p99 {ms(p99)}"))


# --- part: ingestion alone --------------------------------------------------------------------


def ingestion(args, world: World) -> None:
    with Part(world, "ingestion: POST /api/v1/nodes/{id}/logs, alone") as part:
        seconds = int(args.ingest_warmup + args.duration) + 2
        generator = Generator(ingest_spec(args, world, args.rate, seconds, seed=301))
        world.pids["generator"] = [generator.process.pid]
        try:
            ready = generator.expect("ready", 300)
            say(f"  {prepared_line(ready)}")
            generator.go()
            time.sleep(args.ingest_warmup + 0.3)
            part.window()
            time.sleep(args.duration)
            part.window_end()
            result = generator.expect("done", 120)
        finally:
            generator.close()
            world.pids.pop("generator", None)
        world.next_n = result["next_n"]
        mb_s = say_ingestion(result, args, args.rate)
        settle(world)
        world.verdicts.append(("ingestion >= 20 MB/s", mb_s >= TARGET_MB_S, f"{mb_s:.2f} MB/s"))


# --- part: the heartbeat with and without logs -------------------------------------------------


def heartbeats(args, world: World) -> None:
    with Part(world, "heartbeat p99, alone and with the ingestion load"):
        rate = args.rate if args.hb_rate is None else args.hb_rate
        # the ingestion's batches are prepared while the fleet registers and warms up,
        # when nothing is measured
        generator = Generator(ingest_spec(args, world, rate, int(args.ingest_warmup + args.duration) + 4, seed=302))
        world.pids["generator"] = [generator.process.pid]
        try:
            beats = Beats(args.hb_nodes, world.secret, "busy")
            say(f"  registering {args.hb_nodes} heartbeat nodes (busy readings, bench/heartbeats.py's fleet)…")
            seconds, errors = asyncio.run(send_each_once(world.port, beats, args.connections))
            say(f"  registered in {seconds:.1f} s, {sum(errors.values())} not 200")
            warm = asyncio.run(on_schedule(world.port, beats, args.hb_warmup, args.hb_interval, args.connections))
            say(f"  unmeasured warm-up: {args.hb_warmup:g} s on schedule, {warm.done} beats")
            ready = generator.expect("ready", 300)
            say(f"  ingestion load {prepared_line(ready)}")
            offered = args.hb_nodes / args.hb_interval
            results = {}
            for label in ("alone", "with logs"):
                part = Part(world, "")
                if label == "with logs":
                    generator.go()
                    time.sleep(args.ingest_warmup + 0.3)
                part.window()
                result = asyncio.run(on_schedule(world.port, beats, args.duration, args.hb_interval, args.connections))
                part.window_end()
                results[label] = result
                say(
                    f"\n  -- heartbeats {label}: {args.hb_nodes} nodes every {args.hb_interval:g} s "
                    f"(offered {offered:.0f}/s)"
                )
                say(
                    f"  heartbeats           {result.done} in {result.elapsed:.1f} s = "
                    f"{result.done / result.elapsed:.0f}/s; p50 {ms(result.p50)}, p99 {ms(result.p99)}, "
                    f"max {ms(result.max)} (from when each was due)"
                )
                say(f"  not 200              {sum(result.errors.values())} {result.errors or ''}")
                for note in result.notes:
                    say(f"  {note}")
                say(f"  cpu                  {cpu_line(part.cpu_before, part.cpu_after)}")
            ingested = generator.expect("done", 120)
        finally:
            generator.close()
            world.pids.pop("generator", None)
        world.next_n = ingested["next_n"]
        settle(world)
        say("  the ingestion load beside it:")
        say_ingestion(ingested, args, rate, indent="    ")
        alone, loaded = results["alone"].p99, results["with logs"].p99
        ratio = loaded / alone if alone else float("nan")
        say(f"\n  heartbeat p99        alone {ms(alone)}, with logs {ms(loaded)}: ratio {ratio:.2f} (target <= 1.20)")
        world.verdicts.append(("heartbeat p99 with logs within 20 %", ratio <= TARGET_HB_RATIO, f"ratio {ratio:.2f}"))


# --- part: many followers of one chatty task -----------------------------------------------------


@dataclass
class Follower:
    last: int = 0
    lines: int = 0
    events: int = 0
    gaps: int = 0
    repeats: int = 0
    status: int = 0
    ended: bool = False
    error: str = ""
    latencies: list = field(default_factory=list)  # per event: its batch's POST to here
    connected: asyncio.Event = field(default_factory=asyncio.Event)


async def follow(session, world: World, task_id: int, follower: Follower, sent: list[tuple[int, float]]) -> None:
    url = f"{world.url}/api/v1/tasks/{task_id}/logs?follow=true"
    firsts = [first for first, _ in sent]  # grows as batches are sent: read afresh below
    try:
        async with session.get(url, headers={"Authorization": f"Bearer {world.key}"}) as response:
            follower.status = response.status
            if response.status != 200:
                follower.error = (await response.text())[:200]
                follower.connected.set()
                return
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    block, buffer = buffer.split(b"\n\n", 1)
                    kind, data = "", b""
                    for row in block.split(b"\n"):
                        if row.startswith(b"retry:"):
                            follower.connected.set()
                        elif row.startswith(b"event: "):
                            kind = row[7:].decode()
                        elif row.startswith(b"data: "):
                            data = row[6:]
                    if kind == "end":
                        follower.ended = True
                        return
                    if kind != "lines":
                        continue
                    now = time.perf_counter()
                    lines = orjson.loads(data)["lines"]
                    follower.events += 1
                    for line in lines:
                        seq = line["seq"]
                        if seq == follower.last + 1:
                            follower.last = seq
                            follower.lines += 1
                        elif seq <= follower.last:
                            follower.repeats += 1
                        else:
                            follower.gaps += 1
                            follower.last = seq
                            follower.lines += 1
                    if len(firsts) != len(sent):
                        firsts = [first for first, _ in sent]
                    index = bisect.bisect_right(firsts, lines[-1]["seq"]) - 1
                    if index >= 0:
                        follower.latencies.append(now - sent[index][1])
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:  # noqa: BLE001  (counted and shown)
        follower.error = f"{type(exc).__name__}: {exc}"[:200]
        follower.connected.set()


async def chatty_sender(args, world: World, node: str, task_id: int, sent: list, stop_at: float) -> dict:
    """The chatty task's agent: --chatty-lines a second, shipped every --ship-seconds."""
    pool = logload.text_pool(seed=404, size=4096)
    conn = Conn(world.port)
    n, statuses = 0, {}
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    k = 0
    while True:
        k += 1
        due = t0 + k * args.ship_seconds
        if due > stop_at:
            break
        await asyncio.sleep(max(0.0, due - loop.time()))
        count = round(args.chatty_lines * k * args.ship_seconds) - n
        now = time.time()
        lines = [
            [
                n + i,
                round(now - args.ship_seconds + (i + 1) * args.ship_seconds / (count + 1), 6),
                "stdout",
                pool[(n + i) % len(pool)],
            ]
            for i in range(count)
        ]
        body = logload.gzip.compress(
            orjson.dumps({"tasks": [{"task_id": task_id, "run": RUN, "dropped_bytes": 0, "lines": lines}]}),
            compresslevel=args.gzip_level,
        )
        sent.append((n + 1, time.perf_counter()))  # a fresh task: line n is sequence number n + 1
        try:
            status, _ = await conn.request(logload.log_request(node, world.secret, body))
        except (OSError, asyncio.IncompleteReadError, ValueError):
            status = -1
            conn.close()
            conn = Conn(world.port)
        statuses[status] = statuses.get(status, 0) + 1
        n += count
    conn.close()
    return {"lines": n, "statuses": statuses}


def followers(args, world: World) -> None:
    node, task_id = world.chatty
    title = (
        f"{args.followers} followers of one chatty task ({args.chatty_lines:g} lines/s, "
        f"shipped every {args.ship_seconds:g} s)"
    )
    with Part(world, title) as part:

        async def run() -> tuple[list[Follower], dict, float, float]:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=None)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                sent: list[tuple[int, float]] = []
                crowd = [Follower() for _ in range(args.followers)]
                started = time.perf_counter()
                jobs = [asyncio.ensure_future(follow(session, world, task_id, f, sent)) for f in crowd]
                await asyncio.wait_for(asyncio.gather(*(f.connected.wait() for f in crowd)), 60)
                connected = time.perf_counter() - started
                loop = asyncio.get_running_loop()
                await asyncio.to_thread(part.window)
                window_started = time.perf_counter()
                sender = await chatty_sender(args, world, node, task_id, sent, loop.time() + args.duration)
                window = time.perf_counter() - window_started
                await asyncio.to_thread(part.window_end)
                await asyncio.sleep(LAG_GRACE_SECONDS)
                for job in jobs:
                    job.cancel()
                await asyncio.gather(*jobs, return_exceptions=True)
                return crowd, sender, connected, window

        crowd, sender, connected, window = asyncio.run(run())
        last_stored = query(
            world.database_url, "SELECT next_seq - 1 FROM task_log_state WHERE task_id = %s", [task_id]
        )[0][0]
        lags = sorted(last_stored - f.last for f in crowd)
        behind = sum(1 for lag in lags if lag > 0)
        gaps, repeats = sum(f.gaps for f in crowd), sum(f.repeats for f in crowd)
        failed = [f for f in crowd if f.status != 200 or f.error]
        latencies = [value for f in crowd for value in f.latencies]
        delivered = sum(f.lines for f in crowd)
        say(f"  connected            {args.followers} followers in {connected:.2f} s")
        say(
            f"  sent                 {sender['lines']} lines in {window:.1f} s ({sender['lines'] / window:.0f}/s), "
            f"answers {sender['statuses']}; last sequence number stored {last_stored}"
        )
        say(
            f"  delivered            {delivered} lines in all = {delivered / window:,.0f} lines/s "
            f"({delivered / max(len(crowd), 1) / window:.0f}/s per follower), "
            f"{sum(f.events for f in crowd)} events"
        )
        say(
            f"  batch → follower     p50 {ms(percentile(latencies, 0.5))}, p99 {ms(percentile(latencies, 0.99))}, "
            f"max {ms(max(latencies, default=float('nan')))} (a batch's POST to its event at each follower)"
        )
        say(
            f"  lag at the end       {LAG_GRACE_SECONDS:g} s after the last batch: min {lags[0]}, median "
            f"{lags[len(lags) // 2]}, max {lags[-1]} lines; {behind} of {len(crowd)} behind"
        )
        say(f"  gaps / repeats       {gaps} / {repeats} (sequence numbers skipped / seen twice, all followers)")
        if failed:
            say(
                f"  failed followers     {len(failed)}, the first: {failed[0].status} {failed[0].error} "
                "(the web log's errors below say why)"
            )
        world.verdicts.append(
            (
                f"{len(crowd)} followers: none behind, no gap or repeat",
                behind == 0 and gaps == 0 and repeats == 0 and not failed,
                f"{behind} behind, {gaps} gaps, {repeats} repeats, {len(failed)} failed",
            )
        )


# --- set-up and the run ----------------------------------------------------------------------------


def set_up_log_nodes(args, world: World, keepalive: KeepAlive) -> None:
    started = time.perf_counter()
    keepalive.register()
    per_node = args.tasks // args.log_nodes
    nodes = {keepalive.fleet.node_id(n): per_node for n in range(args.log_nodes)}
    chatty_node = keepalive.fleet.node_id(0)
    created = django_script(world.env, TASKS, json.dumps({"tenant": world.tenant, "nodes": nodes}))
    world.log_tasks = {node: ids for node, ids in created.items()}
    extra = django_script(world.env, TASKS, json.dumps({"tenant": world.tenant, "nodes": {chatty_node: 1}}))
    world.chatty = (chatty_node, extra[chatty_node][0])
    world.next_n = {task: 0 for ids in world.log_tasks.values() for task in ids}
    say(
        f"log nodes: {args.log_nodes} registered by their first beats (beating every 5 s from now on), "
        f"{per_node * args.log_nodes} running tasks written on them, and the chatty task "
        f"#{world.chatty[1]} on {chatty_node}, in {time.perf_counter() - started:.1f} s"
    )


def interrupted(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds each load is measured (default 20)")
    parser.add_argument("--print-seconds", type=float, default=30.0, help="how long the printing task prints")
    parser.add_argument("--tasks", type=int, default=500, help="running tasks shipping logs (default 500)")
    parser.add_argument("--log-nodes", type=int, default=50, help="nodes they run on (default 50)")
    parser.add_argument("--rate", type=float, default=20.0, help="MB/s of log text offered in all (default 20)")
    parser.add_argument("--ingest-warmup", type=float, default=5.0, help="unmeasured seconds of ingestion first")
    parser.add_argument("--gzip-level", type=int, default=5, help="the batches' gzip level (the agent's: 5)")
    parser.add_argument(
        "--hb-rate", type=float, default=None, help="MB/s of log text beside the heartbeats (default: --rate)"
    )
    parser.add_argument("--hb-nodes", type=int, default=1000, help="heartbeat fleet (default 1,000)")
    parser.add_argument("--hb-interval", type=float, default=5.0, help="seconds between a node's beats")
    parser.add_argument("--hb-warmup", type=float, default=5.0, help="unmeasured seconds of beats first")
    parser.add_argument("--connections", type=int, default=64, help="the heartbeat generator's connections")
    parser.add_argument("--followers", type=int, default=100)
    parser.add_argument("--chatty-lines", type=float, default=200.0, help="the followed task's lines a second")
    parser.add_argument(
        "--ship-seconds", type=float, default=0.5, help="how often agents ship (log_ship_seconds; the agent's 0.5)"
    )
    parser.add_argument("--workers", type=int, default=2, help="web processes (uvicorn --workers)")
    parser.add_argument("--skip-latency", action="store_true", help="skip print-to-screen (the real agent)")
    parser.add_argument("--skip-ingest", action="store_true", help="skip ingestion alone")
    parser.add_argument("--skip-heartbeats", action="store_true", help="skip the heartbeat with and without logs")
    parser.add_argument("--skip-followers", action="store_true", help="skip the followers")
    parser.add_argument("--keep-logs", action="store_true", help="keep the scratch folder (process logs)")
    args = parser.parse_args()
    if args.tasks < args.log_nodes or args.log_nodes < 1:
        parser.error("--tasks must be at least --log-nodes (each node runs tasks / nodes of them), which is >= 1")

    signal.signal(signal.SIGTERM, interrupted)
    began = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="hf-bench-logs-"))
    (scratch / "static").mkdir()
    stores = ensure_data_stores(scratch, os.environ)
    admin_url = stores.database_url
    database_url = recreate_database(admin_url, DB_NAME)
    secret = secrets.token_urlsafe(24)
    env = server_env(database_url, stores.redis_url, scratch, secret)
    server, jobs, keepalive = None, [], None
    try:
        subprocess.run(
            [sys.executable, "manage.py", "migrate_schemas", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True
        )
        server, port = start_server(
            metrics_group_env(env, scratch, "web"),
            args.workers,
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            log=scratch / "web.log",
        )
        jobs = start_jobs(env, scratch)
        periods = job_periods(env)
        world = World(database_url, env, port, secret)
        world.pids = {"web": [server.pid], "worker+beat": [job.pid for job in jobs], "bench": [os.getpid()]}
        made = django_script(env, SETUP, str(TASK_IDS_FROM + secrets.randbelow(10**9)))
        world.key, world.tenant = made["key"], made["tenant"]
        say(
            f"server: uvicorn, {args.workers} workers, production settings; Celery worker (2 processes) and beat "
            f"running every periodic job; data stores: {stores_in_use(stores)}; machine: {os.cpu_count()} cores; "
            f"load average {load_average()}"
        )
        forget_longest_runs(database_url)
        jobs_before = job_runs(database_url)
        deadlocks_before = deadlocks(database_url)
        logs_from = log_sizes(scratch)
        run_started = time.monotonic()

        if not args.skip_latency:
            print_to_screen(args, world, scratch)
        if not (args.skip_ingest and args.skip_heartbeats and args.skip_followers):
            keepalive = KeepAlive(port, secret, args.log_nodes)
            set_up_log_nodes(args, world, keepalive)
            keepalive.start()
            if not args.skip_ingest:
                ingestion(args, world)
            if not args.skip_heartbeats:
                heartbeats(args, world)
            if not args.skip_followers:
                followers(args, world)
            keepalive.stop()
            failed = sum(keepalive.failed.values())
            say(f"\nlog nodes' own beats: {keepalive.sent} sent, {failed} not 200 {keepalive.failed or ''}")

        elapsed = time.monotonic() - run_started
        time.sleep(1.5)
        deadlocks_after = deadlocks(database_url)
        say(f"\n== whole run ({elapsed:.0f} s after set-up) ==")
        say(
            f"  deadlocks            {deadlocks_after - deadlocks_before} "
            f"(pg_stat_database.deadlocks: {deadlocks_before} before, {deadlocks_after} after)"
        )
        say_jobs(periods, jobs_before, job_runs(database_url), elapsed)
        say("  process logs:")
        say_log_marks(log_lines_since(scratch, logs_from), indent="    ")
        say("\n== targets ==")
        for what, met, figure in world.verdicts:
            say(f"  {'MET   ' if met else 'MISSED'} {what}: {figure}")
        say(f"\n(the whole bench took {time.monotonic() - began:.0f} s)")
        return 0
    except KeyboardInterrupt:
        say("\ninterrupted: stopping everything")
        return 1
    finally:
        if keepalive is not None:
            keepalive.stopping.set()
        stop(jobs + ([server] if server is not None else []))
        drop_database(admin_url, DB_NAME)
        stores.stop()
        if args.keep_logs:
            say(f"logs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
