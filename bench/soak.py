"""Soak: the whole control plane under a steady mixed load for DURATION minutes.

    make soak DURATION=30
    .venv/bin/python bench/soak.py --duration 2 --nodes 200

What runs, as `make up` runs it (production settings): the web process (uvicorn,
--workers processes), a Celery worker (--concurrency 2) and Celery beat, so every
periodic job runs on its real period. Against it, from this process, all to 127.0.0.1:

- heartbeats: --nodes simulated nodes (8 GPUs each, readings moving every beat:
  bench/busy.py) on their 5 s schedule, each at its own phase;
- tasks: --tasks-per-minute one-card tasks created through POST /api/v1/tasks with a
  platform key, bound by the real scheduler and worked by the simulated nodes as agents
  do on the task channel (as bench/fleet.py --run-tasks: the tasks a beat's answer lists
  are claimed scheduled → running, "run" for --task-seconds and reported completed);
- gateway: --gateway-rate chat completions a second through /v1/chat/completions to an
  inference service whose one replica is the stand-in upstream (bench/gateway.py's, under
  uvicorn), and --direct-rate a second straight to that upstream: the gateway's added
  p99 is its p99 minus the upstream's own in the same minute (as bench/gateway.py's
  "added").

Each minute it prints the RSS of web, worker and beat (each process tree summed), the
achieved rates next to the offered ones, the heartbeat p99, the gateway's added p99, the
5xx answers (heartbeats, task API, gateway) and PostgreSQL's deadlocks (the delta of
pg_stat_database.deadlocks). After the duration it stops the gateway traffic and the
submissions, keeps beating until every task submitted has ended (at most --drain
seconds), checks in the database that each ended exactly once, and prints a verdict
against the targets: RSS flat within 10 % after the first 5 minutes, no 5xx, no
deadlock, every task ended once.

Uses DATABASE_URL / REDIS_URL when set, else the embedded pair in a scratch folder; works
in a database of its own, heteroflow_soak, dropped before and after. Stops by itself and
stops everything it started, also on Ctrl-C. The exit status is 0 when the verdict passes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.busy import BusyFleet  # noqa: E402
from bench.gateway import BODY as CHAT_BODY  # noqa: E402
from bench.gateway import MODEL  # noqa: E402
from bench.gateway import SETUP as GATEWAY_SETUP  # noqa: E402
from bench.heartbeats import (  # noqa: E402
    Connection,
    beat_request,
    drop_database,
    free_port,
    percentile,
    recreate_database,
    server_env,
    stores_in_use,
    wait_for,
)
from heteroflow.embedded import ensure_data_stores  # noqa: E402
from heteroflow.launcher import metrics_group_env, web_command  # noqa: E402
from tests.nodes.payloads import heartbeat  # noqa: E402

DB_NAME = "heteroflow_soak"
TENANT = "soak"
RSS_FLAT = 0.10  # each process tree's RSS within 10 % of its level after the warm-up
WARMUP_MINUTES = 5
REQUEST_TIMEOUT = 30.0
STOP_GRACE_SECONDS = 15
REPORT_TRIES = 30  # a completion report retried once a second, at most this often

# The soak's tenant (quotas out of the way: the load, not a limit, is under test) and a
# platform key to create its tasks with.
TENANT_SETUP = r"""
import sys, django
django.setup()
from django.contrib.auth import get_user_model
from apps.tenants.services import create_tenant, issue_platform_key
create_tenant(name="Soak", slug=sys.argv[1], max_concurrent_tasks=10_000_000, max_gpus=10_000_000)
user = get_user_model().objects.create_superuser("soak", "soak@example.test", "x")
print(issue_platform_key(user=user, name="soak").key)
"""

TERMINAL = ("completed", "failed", "cancelled", "stopped")
REQUEUE_EVENTS = ("requeued", "replica_requeued")


def say(message: str) -> None:
    print(message, flush=True)


# --- the processes --------------------------------------------------------------------


class Processes:
    """The processes the soak starts, each in a session of its own (Ctrl-C at the
    terminal reaches only the soak, which stops them in order), logs in `log_dir`."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.started: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.started[name] = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self.started[name]

    def check_alive(self) -> None:
        for name, process in self.started.items():
            if process.poll() is not None:
                raise SystemExit(f"{name} exited with code {process.returncode}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop_all(self) -> None:
        for process in reversed(self.started.values()):
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for process in reversed(self.started.values()):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()


def tree_rss(pid: int) -> int:
    """Bytes resident in the process and all its descendants (uvicorn's workers,
    Celery's pool children)."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in family:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def deadlocks(database_url: str) -> int:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").fetchone()[0]


IDLE_REOPEN_SECONDS = 4.0  # below uvicorn's keep-alive time-out (5 s), after which it closes


class Conn(Connection):
    """bench/heartbeats.py's keep-alive connection, also reading chunked bodies (uvicorn
    sends one when the application gives no Content-Length, as the upstream does), and
    opened afresh after idling as long as the server keeps it (else the next request
    would meet a connection the server has just closed)."""

    used_at = 0.0

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        now = time.monotonic()
        if self.writer is not None and now - self.used_at > IDLE_REOPEN_SECONDS:
            self.writer.close()
            self.writer = None
        self.used_at = now
        if self.writer is None:
            await self.open()
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, chunked = 0, False
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if not chunked:
            return status, await self.reader.readexactly(length) if length else b""
        body = b""
        for _ in range(100_000):  # bounded: a chunk of size 0 ends the body
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")  # no trailers are sent
                return status, body
            body += await self.reader.readexactly(size)
            await self.reader.readexactly(2)
        raise ValueError("a chunked body without an end")


def upstream_app():
    """uvicorn --factory bench.soak:upstream_app: bench/gateway.py's upstream, keeping
    only its last requests (it records every one, which a soak's hours would pile up)."""
    import collections

    from bench.gateway import upstream_app as standin

    app = standin()
    app.requests = collections.deque(maxlen=100)
    return app


# --- what is counted ------------------------------------------------------------------


@dataclass
class Window:
    """What happened in one minute (requests counted when they end)."""

    beats: int = 0
    beat_latencies: list = field(default_factory=list)
    submitted: int = 0
    claimed: int = 0
    completed: int = 0
    gateway: int = 0
    gateway_latencies: list = field(default_factory=list)
    direct_latencies: list = field(default_factory=list)
    lag: list = field(default_factory=list)  # how late the generator sent what was due
    fivexx: dict = field(default_factory=lambda: {"heartbeat": 0, "task API": 0, "gateway": 0})
    other: dict = field(default_factory=dict)  # "kind status" → count: 4xx, time-outs, resets
    fivexx_codes: dict = field(default_factory=dict)  # "kind status" → count

    def answered(self, kind: str, status: int, ok: tuple[int, ...]) -> bool:
        if status in ok:
            return True
        if status >= 500:
            self.fivexx[kind] += 1
            key = f"{kind} {status}"
            self.fivexx_codes[key] = self.fivexx_codes.get(key, 0) + 1
        else:
            key = f"{kind} {status if status > 0 else 'no answer'}"
            self.other[key] = self.other.get(key, 0) + 1
        return False


class Tally:
    def __init__(self):
        self.current = Window()
        self.closed: list[Window] = []

    def close(self) -> Window:
        window, self.current = self.current, Window()
        self.closed.append(window)
        return window


# --- the load -------------------------------------------------------------------------


class Load:
    def __init__(self, args, web_port: int, upstream_port: int, agent_secret: str, platform_key: str, gw_key: str):
        self.args = args
        self.web_port, self.upstream_port = web_port, upstream_port
        self.agent_secret, self.platform_key, self.gw_key = agent_secret, platform_key, gw_key
        self.tally = Tally()
        self.fleet = BusyFleet("soak", args.nodes, seed=args.seed)
        self.submitted: list[int] = []
        self.claims: dict[int, list[str]] = {}  # task → the nodes whose claim the server took
        self.reports: dict[int, list[str]] = {}  # task → the nodes whose report the server took
        self.taken: list[set[int]] = [set() for _ in range(args.nodes + 1)]
        self.work: set[asyncio.Task] = set()
        self.sent = {"beats": 0, "gateway": 0, "direct": 0, "submits": 0}
        self.sent_in_duration = self.sent
        self.stopping = asyncio.Event()  # the duration is over: gateway and submissions stop
        self.done = asyncio.Event()  # the drain is over: the beats stop too

    # one pool of keep-alive connections per kind of traffic, so one cannot starve another
    def pool(self, port: int, size: int) -> asyncio.Queue:
        pool: asyncio.Queue[Conn] = asyncio.LifoQueue()  # the connections used last stay warm
        for _ in range(size):
            pool.put_nowait(Conn(port))
        return pool

    async def request(self, pool: asyncio.Queue, port: int, raw: bytes) -> tuple[int, bytes]:
        conn = await pool.get()
        try:
            return await asyncio.wait_for(conn.request(raw), REQUEST_TIMEOUT)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            if conn.writer is not None:
                conn.writer.close()
            conn = Conn(port)
            return -1, b""
        finally:
            pool.put_nowait(conn)

    def raw(self, method: str, path: str, body: bytes, headers: str) -> bytes:
        return (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    # heartbeats, and the agents' side of the task channel
    async def register(self, gateway_node_beat: bytes) -> float:
        """Every node's first beat (the slow path that registers it), before the clock
        starts, as a fleet that has been up a while would have done; its seconds."""
        loop = asyncio.get_running_loop()
        pool = self.pool(self.web_port, self.args.connections)
        started = loop.time()

        async def first(raw: bytes):
            for _ in range(5):  # bounded: a node refused five times is left to its schedule
                status, _ = await self.request(pool, self.web_port, raw)
                if status == 200:
                    return

        nodes = range(self.args.nodes)
        beats = [beat_request(self.fleet.node_id(n), self.agent_secret, self.fleet.body(n)) for n in nodes]
        await asyncio.gather(first(gateway_node_beat), *(first(raw) for raw in beats))
        return loop.time() - started

    async def beats(self, gateway_node_beat: bytes):
        args, loop = self.args, asyncio.get_running_loop()
        pool = self.pool(self.web_port, args.connections)
        # the gateway's node beats on a connection of its own: under a backlog of fleet
        # beats in the client, its own would wait, the node be judged offline and the
        # gateway's route go with it, a failure of the generator, not of the server
        own = self.pool(self.web_port, 1)
        nodes = args.nodes + 1  # the last is the node the gateway's replica runs on
        t0 = loop.time()
        for k in range(10**9):  # bounded: `done` ends it long before
            round_, n = divmod(k, nodes)
            at = t0 + (n / nodes + round_) * args.interval
            delay = at - loop.time()
            if delay > 0:
                try:
                    await asyncio.wait_for(self.done.wait(), delay)
                except TimeoutError:
                    pass
            if self.done.is_set():
                break
            self.tally.current.lag.append(loop.time() - at)
            if n == args.nodes:
                self.spawn(self.beat(own, n, gateway_node_beat, at))
            else:
                raw = beat_request(self.fleet.node_id(n), self.agent_secret, self.fleet.body(n))
                self.spawn(self.beat(pool, n, raw, at))

    def spawn(self, coroutine):
        job = asyncio.ensure_future(coroutine)
        self.work.add(job)
        job.add_done_callback(self.work.discard)

    async def beat(self, pool, n: int, raw: bytes, due: float):
        self.sent["beats"] += 1
        status, body = await self.request(pool, self.web_port, raw)
        window = self.tally.current
        window.beats += 1
        window.beat_latencies.append(asyncio.get_running_loop().time() - due)
        if not window.answered("heartbeat", status, (200,)):
            return
        for task_id in orjson.loads(body).get("scheduled_tasks") or ():
            if task_id not in self.taken[n]:
                self.taken[n].add(task_id)
                self.spawn(self.run_task(n, task_id))

    def node_id(self, n: int) -> str:
        return "bench-node" if n == self.args.nodes else self.fleet.node_id(n)

    async def put(self, pool, task_id: int, body: dict) -> int:
        raw = self.raw("PUT", f"/api/v1/tasks/{task_id}", orjson.dumps(body), f"X-API-Key: {self.agent_secret}\r\n")
        status, _ = await self.request(pool, self.web_port, raw)
        return status

    async def run_task(self, n: int, task_id: int):
        pool = self.task_pool
        node_id = self.node_id(n)
        claim = {"node_id": node_id, "from_status": "scheduled", "status": "running"}
        status = await self.put(pool, task_id, claim)
        if not self.tally.current.answered("task API", status, (200,)):
            self.taken[n].discard(task_id)  # listed again on a later beat if it is still ours
            return
        self.claims.setdefault(task_id, []).append(node_id)
        self.tally.current.claimed += 1
        await asyncio.sleep(self.args.task_seconds)
        report = {"node_id": node_id, "from_status": "running", "status": "completed", "exit_code": 0}
        for _ in range(REPORT_TRIES):
            status = await self.put(pool, task_id, report)
            if self.tally.current.answered("task API", status, (200,)):
                self.reports.setdefault(task_id, []).append(node_id)
                self.tally.current.completed += 1
                return
            if 400 <= status < 500:
                return  # refused: retrying cannot help
            await asyncio.sleep(1.0)

    # task submissions
    async def submissions(self):
        args, loop = self.args, asyncio.get_running_loop()
        pool = self.pool(self.web_port, 8)
        gap = 60.0 / args.tasks_per_minute
        t0 = loop.time()
        for i in range(10**9):  # bounded: `stopping` ends it
            delay = t0 + i * gap - loop.time()
            if delay > 0:
                try:
                    await asyncio.wait_for(self.stopping.wait(), delay)
                except TimeoutError:
                    pass
            if self.stopping.is_set():
                break
            body = {"tenant": TENANT, "name": f"soak-{i}", "image": "busybox", "gpu_required": 1}
            self.spawn(self.submit(pool, orjson.dumps(body)))

    async def submit(self, pool, body: bytes):
        self.sent["submits"] += 1
        raw = self.raw("POST", "/api/v1/tasks", body, f"Authorization: Bearer {self.platform_key}\r\n")
        status, answer = await self.request(pool, self.web_port, raw)
        if self.tally.current.answered("task API", status, (201,)):
            self.submitted.append(orjson.loads(answer)["id"])
            self.tally.current.submitted += 1

    # gateway traffic, and the upstream alone for its own latency
    async def chat(self, port: int, rate: float, headers: str, gateway: bool):
        loop = asyncio.get_running_loop()
        pool = self.pool(port, self.args.connections)
        raw = self.raw("POST", "/v1/chat/completions", orjson.dumps(CHAT_BODY), headers)
        t0 = loop.time()
        for i in range(10**9):  # bounded: `stopping` ends it
            at = t0 + i / rate
            delay = at - loop.time()
            if delay > 0:
                try:
                    await asyncio.wait_for(self.stopping.wait(), delay)
                except TimeoutError:
                    pass
            if self.stopping.is_set():
                break
            self.tally.current.lag.append(loop.time() - at)
            self.spawn(self.completion(pool, port, raw, at, gateway))

    async def completion(self, pool, port: int, raw: bytes, due: float, gateway: bool):
        self.sent["gateway" if gateway else "direct"] += 1
        status, _ = await self.request(pool, port, raw)
        latency = asyncio.get_running_loop().time() - due
        window = self.tally.current
        if gateway:
            window.gateway += 1
            if window.answered("gateway", status, (200,)):
                window.gateway_latencies.append(latency)
        elif status == 200:
            window.direct_latencies.append(latency)
        else:
            window.answered("upstream", status, ())


# --- the report -----------------------------------------------------------------------

HEADER = (
    f"{'min':>4} {'load1':>5} | {'web MB':>6} {'worker':>6} {'beat':>6} | "
    f"{'beats/s':>13} {'hb p99':>7} | {'tasks/min':>13} {'claim':>5} {'done':>5} | "
    f"{'gateway/s':>13} {'gw p99':>7} {'up p99':>7} {'added':>7} | {'5xx hb/task/gw':>14} {'dlk':>3} {'lag':>5}"
)


def ms(values: list[float]) -> float:
    return percentile(values, 0.99) * 1000 if values else float("nan")


def minute_line(label: str, window: Window, seconds: float, rss: dict, load1: float, deadlocked: int, args) -> str:
    beats_offered = (args.nodes + 1) / args.interval
    gw, up = ms(window.gateway_latencies), ms(window.direct_latencies)
    mb = {name: value / 2**20 for name, value in rss.items()}
    fivexx = window.fivexx
    return (
        f"{label:>4} {load1:5.2f} | {mb['web']:6.0f} {mb['worker']:6.0f} {mb['beat']:6.0f} | "
        f"{window.beats / seconds:5.0f} of {beats_offered:4.0f} {ms(window.beat_latencies):7.1f} | "
        f"{window.submitted * 60 / seconds:5.0f} of {args.tasks_per_minute:4.0f} "
        f"{window.claimed:5} {window.completed:5} | "
        f"{window.gateway / seconds:5.0f} of {args.gateway_rate:4.0f} {gw:7.1f} {up:7.1f} {gw - up:7.1f} | "
        f"{fivexx['heartbeat']:4}/{fivexx['task API']:4}/{fivexx['gateway']:4} {deadlocked:3} {ms(window.lag):5.0f}"
        + (f"  other: {window.other}" if window.other else "")
    )


class Monitor:
    """Each minute: RSS of each process tree, deadlocks, the minute's figures."""

    def __init__(self, args, load: Load, pids: dict[str, int], database_url: str):
        self.args, self.load, self.pids, self.database_url = args, load, pids, database_url
        self.rss: list[dict[str, int]] = []
        self.deadlocks_at_start = deadlocks(database_url)
        self.deadlocks_seen = self.deadlocks_at_start
        self.loads: list[float] = []

    def sample(self) -> tuple[dict[str, int], int]:
        rss = {name: tree_rss(pid) for name, pid in self.pids.items()}
        now = deadlocks(self.database_url)
        delta, self.deadlocks_seen = now - self.deadlocks_seen, now
        return rss, delta

    async def minute(self, label: str, seconds: float, *, keep_rss: bool = True) -> None:
        window = self.load.tally.close()
        rss, delta = await asyncio.to_thread(self.sample)
        load1 = os.getloadavg()[0]
        self.loads.append(load1)
        if keep_rss:
            self.rss.append(rss)
        say(minute_line(label, window, seconds, rss, load1, delta, self.args))

    @property
    def deadlocks_total(self) -> int:
        return self.deadlocks_seen - self.deadlocks_at_start


def task_outcomes(database_url: str, submitted: list[int]) -> dict:
    """What the database says of the tasks submitted: statuses, settlements, requeues, and
    the tasks of the soak's tenant that nobody submitted (a create answered twice)."""
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        statuses = dict(
            conn.execute(
                "SELECT status, count(*) FROM tasks WHERE id = ANY(%s) GROUP BY status", [submitted]
            ).fetchall()
        )
        settled = dict(
            conn.execute(
                "SELECT task_id, count(*) FROM usage_records WHERE task_id = ANY(%s) GROUP BY task_id", [submitted]
            ).fetchall()
        )
        requeued = conn.execute(
            "SELECT count(DISTINCT task_id) FROM task_events WHERE task_id = ANY(%s) AND kind = ANY(%s)",
            [submitted, list(REQUEUE_EVENTS)],
        ).fetchone()[0]
        in_tenant = conn.execute(
            "SELECT count(*) FROM tasks t JOIN tenants n ON n.id = t.tenant_id WHERE n.slug = %s", [TENANT]
        ).fetchone()[0]
    return {"statuses": statuses, "settled": settled, "requeued": requeued, "in_tenant": in_tenant}


def ended(database_url: str, submitted: list[int]) -> int:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*) FROM tasks WHERE id = ANY(%s) AND status = ANY(%s)", [submitted, list(TERMINAL)]
        ).fetchone()[0]


def rss_flatness(samples: list[dict[str, int]]) -> tuple[int, dict[str, float]]:
    """The minute after which RSS is judged (the warm-up's end, or the first minute of a
    run too short for it) and each process tree's largest drift from it, as a fraction."""
    base = WARMUP_MINUTES if len(samples) > WARMUP_MINUTES else 1
    if not samples:
        return base, {}
    reference = samples[base - 1]
    drift = {}
    for name, value in reference.items():
        later = [sample[name] for sample in samples[base - 1 :]]
        drift[name] = max(abs(v - value) for v in later) / value if value else float("inf")
    return base, drift


# --- the run --------------------------------------------------------------------------


async def soak(args, load: Load, monitor: Monitor, gateway_node_beat: bytes, processes: Processes) -> float:
    loop = asyncio.get_running_loop()
    load.task_pool = load.pool(load.web_port, 16)
    registered = await load.register(gateway_node_beat)
    say(f"registered {args.nodes + 1} nodes in {registered:.1f} s (their first beats, before the clock starts)")
    say(HEADER)
    started = loop.time()
    generators = [
        asyncio.ensure_future(load.beats(gateway_node_beat)),
        asyncio.ensure_future(load.submissions()),
        asyncio.ensure_future(
            load.chat(load.web_port, args.gateway_rate, f"Authorization: Bearer {load.gw_key}\r\n", True)
        ),
        asyncio.ensure_future(load.chat(load.upstream_port, args.direct_rate, "", False)),
    ]
    try:
        for minute in range(1, int(args.duration) + 1):
            await asyncio.sleep(max(0.0, started + minute * 60 - loop.time()))
            processes.check_alive()
            await monitor.minute(str(minute), 60.0)
        load.stopping.set()
        load.sent_in_duration = dict(load.sent)
        drain_started = loop.time()
        say(f"  …submissions and gateway traffic stopped; beating until the {len(load.submitted)} tasks have ended")
        while loop.time() - drain_started < args.drain:
            if len(load.claims) == len(load.reports) and await asyncio.to_thread(
                ended, monitor.database_url, load.submitted
            ) == len(load.submitted):
                break
            await asyncio.sleep(2.0)
        drained = loop.time() - drain_started
        await monitor.minute("end", max(drained, 1.0), keep_rss=False)
        return drained
    finally:
        load.stopping.set()
        load.done.set()
        for job in generators:
            job.cancel()
        for job in list(load.work):
            job.cancel()
        await asyncio.gather(*generators, *list(load.work), return_exceptions=True)


def setup_stores_and_keys(env: dict, upstream_port: int) -> tuple[str, str, int]:
    """Migrations, the soak's tenant and platform key, and the gateway's inference service
    (bench/gateway.py's: one replica on node bench-node, the upstream's port)."""
    import psycopg

    subprocess.run(
        [sys.executable, "manage.py", "migrate_schemas", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True
    )

    def script(code: str, *argv: str) -> str:
        result = subprocess.run(
            [sys.executable, "-c", code, *argv], cwd=REPO, env=env, capture_output=True, text=True, check=True
        )
        return result.stdout.strip().splitlines()[-1]

    gw_key = script(GATEWAY_SETUP, str(upstream_port), MODEL)
    platform_key = script(TENANT_SETUP, TENANT)
    with psycopg.connect(env["DATABASE_URL"], autocommit=True) as conn:
        replica = conn.execute("SELECT id FROM tasks WHERE node_id = 'bench-node'").fetchone()[0]
    return gw_key, platform_key, replica


def gateway_node_beat(secret: str, replica: int) -> bytes:
    """The beat of the node the gateway's replica runs on, its probe passing: without it
    the node would be judged offline and the route would go. It lists no live tasks (like
    the simulated nodes), so the stalled-task check leaves its tasks alone."""
    payload = heartbeat(gpus=1)
    payload.pop("live_task_ids")
    payload.update(hostname="bench-node", internal_ip="127.0.0.1", task_health=[{"task_id": replica, "healthy": True}])
    return beat_request("bench-node", secret, orjson.dumps(payload))


def interrupted(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=30, help="minutes of load (default 30)")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between a node's beats")
    parser.add_argument("--tasks-per-minute", type=float, default=200.0)
    parser.add_argument("--task-seconds", type=float, default=10.0, help="how long a simulated task runs")
    parser.add_argument("--gateway-rate", type=float, default=300.0, help="gateway requests a second")
    parser.add_argument("--direct-rate", type=float, default=30.0, help="requests a second straight to the upstream")
    parser.add_argument("--workers", type=int, default=2, help="web processes (uvicorn --workers)")
    parser.add_argument("--connections", type=int, default=64, help="keep-alive connections per traffic kind")
    parser.add_argument("--drain", type=float, default=180.0, help="seconds at most to wait for the last tasks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.duration < 1:
        parser.error("--duration is in whole minutes, at least 1")

    # Ctrl-C and SIGTERM stop the soak through the `finally` below (SIGINT's handler set
    # again: a shell starting the soak in the background would have it ignored).
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    scratch = Path(tempfile.mkdtemp(prefix="hf-soak-"))
    (scratch / "static").mkdir()
    (scratch / "logs").mkdir()
    processes = Processes(scratch / "logs")
    stores = ensure_data_stores(scratch, os.environ)
    admin_url = stores.database_url
    database_url = recreate_database(admin_url, DB_NAME)
    secret = secrets.token_urlsafe(24)
    env = server_env(database_url, stores.redis_url, scratch, secret) | {"PYTHONUNBUFFERED": "1"}
    verdict_ok = False
    try:
        upstream_port, web_port = free_port(), free_port()
        processes.start(
            "upstream",
            [sys.executable, "-m", "uvicorn", "--factory", "bench.soak:upstream_app", "--port", str(upstream_port)]
            + ["--log-level", "critical", "--no-access-log", "--lifespan", "off"],
            env,
        )
        gw_key, platform_key, replica = setup_stores_and_keys(env, upstream_port)
        python = sys.executable
        web = processes.start(
            "web",
            web_command(
                "127.0.0.1", web_port, "--workers", str(args.workers), "--no-access-log", "--log-level", "warning"
            ),
            metrics_group_env(env, scratch, "web"),
        )
        worker = processes.start(
            "worker",
            [python, "-m", "celery", "-A", "celery_worker", "worker", "--loglevel", "INFO", "--concurrency", "2"],
            metrics_group_env(env, scratch, "worker"),
        )
        beat = processes.start(
            "beat",
            [python, "-m", "celery", "-A", "celery_worker", "beat", "--loglevel", "INFO"]
            + ["--schedule", str(scratch / "celerybeat-schedule")],
            metrics_group_env(env, scratch, "beat"),
        )
        wait_for(f"http://127.0.0.1:{upstream_port}/v1/models")
        wait_for(f"http://127.0.0.1:{web_port}/health")
        say(
            f"soak: {args.duration} min; web: uvicorn, {args.workers} process(es), production settings; Celery worker "
            f"(concurrency 2) and beat; data stores: {stores_in_use(stores)}; machine: {os.cpu_count()} cores\n"
            f"offered: {args.nodes} nodes + the gateway's node beating every {args.interval:g} s "
            f"({(args.nodes + 1) / args.interval:.0f}/s), {args.tasks_per_minute:g} tasks/min "
            f"(each runs {args.task_seconds:g} s), gateway {args.gateway_rate:g}/s, "
            f"upstream alone {args.direct_rate:g}/s"
        )
        load = Load(args, web_port, upstream_port, secret, platform_key, gw_key)
        monitor = Monitor(args, load, {"web": web.pid, "worker": worker.pid, "beat": beat.pid}, database_url)
        drained = asyncio.run(soak(args, load, monitor, gateway_node_beat(secret, replica), processes))
        verdict_ok = report(args, load, monitor, database_url, drained)
        if not verdict_ok:
            for name in ("web", "worker", "beat"):
                say(f"\n--- the last lines of {name}'s log\n{processes.tail(name)}")
    except KeyboardInterrupt:
        say("\ninterrupted: stopping everything")
    finally:
        processes.stop_all()
        drop_database(admin_url, DB_NAME)
        stores.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if verdict_ok else 1


def report(args, load: Load, monitor: Monitor, database_url: str, drained: float) -> bool:
    windows = load.tally.closed
    seconds = args.duration * 60
    loaded = windows[: args.duration]
    fivexx = {kind: sum(w.fivexx[kind] for w in windows) for kind in ("heartbeat", "task API", "gateway")}
    other: dict[str, int] = {}
    for window in windows:
        for key, count in window.other.items():
            other[key] = other.get(key, 0) + count
    beats = sum(w.beats for w in loaded)
    gateway = sum(w.gateway for w in loaded)
    submitted = sum(w.submitted for w in loaded)
    say(f"\n== in all ({args.duration} min of load, then {drained:.0f} s until the last task ended) ==")
    say(
        f"  heartbeats   offered {(args.nodes + 1) / args.interval:.0f}/s, achieved {beats / seconds:.0f}/s; "
        f"p99 {ms([v for w in loaded for v in w.beat_latencies]):.1f} ms"
    )
    say(
        f"  tasks        offered {args.tasks_per_minute:g}/min, created {submitted * 60 / seconds:.0f}/min "
        f"({len(load.submitted)} in all)"
    )
    gw = ms([v for w in loaded for v in w.gateway_latencies])
    up = ms([v for w in loaded for v in w.direct_latencies])
    say(
        f"  gateway      offered {args.gateway_rate:g}/s, achieved {gateway / seconds:.0f}/s; p99 {gw:.1f} ms, "
        f"upstream alone p99 {up:.1f} ms, added p99 {gw - up:.1f} ms"
    )
    sent = load.sent_in_duration
    say(
        f"  generator    sent {sent['beats'] / seconds:.0f} beats/s, {sent['gateway'] / seconds:.0f} gateway "
        f"requests/s, {sent['direct'] / seconds:.0f} upstream requests/s, {sent['submits'] * 60 / seconds:.0f} "
        "creates/min; "
        f"lag p99 {ms([v for w in loaded for v in w.lag]):.0f} ms (how late it sent what was due)"
    )
    say(f"  5xx          heartbeats {fivexx['heartbeat']}, task API {fivexx['task API']}, gateway {fivexx['gateway']}")
    codes: dict[str, int] = {}
    for window in windows:
        for key, n in window.fivexx_codes.items():
            codes[key] = codes.get(key, 0) + n
    if codes:
        say(f"  5xx by status {codes}")
    if other:
        say(f"  other non-2xx {other}")
    say(f"  deadlocks    {monitor.deadlocks_total}")
    say(f"  load average per minute: {', '.join(f'{v:.2f}' for v in monitor.loads)} ({os.cpu_count()} cores)")

    outcome = task_outcomes(database_url, load.submitted)
    count = len(load.submitted)
    never_ended = count - sum(n for status, n in outcome["statuses"].items() if status in TERMINAL)
    settled_twice = sum(1 for n in outcome["settled"].values() if n > 1)
    unsettled = count - len(outcome["settled"])
    # a claim is a CAS from scheduled (a repeat answers 409): a task whose claim was taken
    # twice went back to scheduled in between and ran twice, on one node or two
    claimed_twice = sum(1 for nodes in load.claims.values() if len(nodes) > 1)
    on_two_nodes = sum(1 for nodes in load.claims.values() if len(set(nodes)) > 1)
    not_claimed = sum(1 for task in load.submitted if task not in load.claims)
    reported_twice = sum(1 for nodes in load.reports.values() if len(nodes) > 1)
    extra = outcome["in_tenant"] - count
    once = count > 0 and not (
        never_ended or settled_twice or unsettled or claimed_twice or reported_twice or outcome["requeued"] or extra
    )
    say(
        f"  tasks ended  {count - never_ended} of {count} in a terminal status {outcome['statuses']}; "
        f"settled once {count - unsettled - settled_twice}, twice {settled_twice}; "
        f"claimed twice {claimed_twice} (on two nodes {on_two_nodes}), never {not_claimed}; "
        f"reported twice {reported_twice}; requeued {outcome['requeued']}; "
        f"created but not answered {extra}"
    )

    base, drift = rss_flatness(monitor.rss)
    rss_ok = all(value <= RSS_FLAT for value in drift.values())
    shown = ", ".join(
        f"{name} {monitor.rss[base - 1][name] / 2**20:.0f} MB → {monitor.rss[-1][name] / 2**20:.0f} MB "
        f"(±{value * 100:.1f} % at most)"
        for name, value in drift.items()
    )
    note = "" if base == WARMUP_MINUTES else f"; the run is too short for the {WARMUP_MINUTES}-minute warm-up"
    say(f"  RSS from minute {base}{note}: {shown}")
    achieved = (
        beats / seconds >= 0.95 * (args.nodes + 1) / args.interval
        and gateway / seconds >= 0.95 * args.gateway_rate
        and submitted * 60 / seconds >= 0.95 * args.tasks_per_minute
    )
    checks = [
        (f"RSS flat within {RSS_FLAT:.0%} after minute {base}", rss_ok),
        (f"0 5xx ({sum(fivexx.values())})", not sum(fivexx.values())),
        (f"0 deadlocks ({monitor.deadlocks_total})", not monitor.deadlocks_total),
        ("every task ended exactly once", once),
    ]
    passed = all(ok for _, ok in checks)
    say(
        f"\nVERDICT {'PASS' if passed else 'FAIL'}: "
        + "; ".join(f"{'ok' if ok else 'FAILED'} {what}" for what, ok in checks)
        + ("" if achieved else "  (the offered load was not all achieved: see the rates above)")
    )
    return passed


if __name__ == "__main__":
    sys.exit(main())
