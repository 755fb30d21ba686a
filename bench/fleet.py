"""A simulated fleet: N nodes sending real heartbeats over HTTP to a running control
plane, each on its own schedule with jitter (every beat's gap drawn from interval ±
jitter). The fault tests start it as a separate process and kill it to make a rack go
silent; it also serves for longer runs by hand:

    .venv/bin/python bench/fleet.py --url http://127.0.0.1:3333 --secret "$HETEROFLOW_AGENT_SECRET" \\
        --nodes 500 --interval 5 --jitter 0.2 --duration 300

The nodes report no live_task_ids (like agents without an executor), so they never make
the stalled-task check judge tasks bound to them. On SIGTERM, or after --duration, it
prints one JSON line: beats sent, failures by status, and the longest gap between two
beats of any node.

Several `--url`s spread the nodes over control-plane instances (node n starts on url n mod
k) and stand for a load balancer: a node whose instance stops answering moves to the next.
With `--run-tasks SECONDS` the nodes also work like agents on the real task channel: the
tasks a beat's answer lists are claimed (scheduled → running), "run" for SECONDS and
reported completed, each report retried (on any instance) until one answers; a claim
whose answer was lost (a 5xx, or none) is looked up, since the server may have applied it
before failing, and run when the task is running here (claims_confirmed); the figures
then include the claims, the reports and the most tasks a node ever ran at once. With
`--busy` every beat's readings move (memory, power, utilisation, now and then a card's
health counters), as a busy fleet's do (bench/busy.py); without it they are the same every
beat.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import signal
import sys
from pathlib import Path

import aiohttp
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.busy import BusyFleet  # noqa: E402
from bench.heartbeats import Connection, beat_request  # noqa: E402
from tests.nodes.payloads import heartbeat  # noqa: E402


def payloads(args) -> list[bytes]:
    base = heartbeat(gpus=args.gpus)
    base.pop("live_task_ids")
    base["gpu_stats"] = [dict(stat, utilization=5.0, memory_used_mb=1024) for stat in base["gpu_stats"]]
    base["heartbeat_interval"] = max(5, round(args.interval))
    return [
        beat_request(
            f"{args.prefix}-{n:05d}",
            args.secret,
            orjson.dumps(dict(base, hostname=f"{args.prefix}-{n:05d}", internal_ip=f"10.9.{n // 256}.{n % 256}")),
        )
        for n in range(args.nodes)
    ]


async def run(args) -> dict:
    ports = [int(url.rsplit(":", 1)[1].rstrip("/")) for url in args.url]
    requests = payloads(args)
    busy = (
        BusyFleet(
            args.prefix, args.nodes, gpus=args.gpus, seed=args.seed, heartbeat_interval=max(5, round(args.interval))
        )
        if args.busy
        else None
    )
    rng = random.Random(args.seed)
    pools: list[asyncio.Queue[Connection]] = []
    for port in ports:
        pool: asyncio.Queue[Connection] = asyncio.Queue()
        for _ in range(args.connections):
            pool.put_nowait(Connection(port))
        pools.append(pool)
    stats = {"nodes": args.nodes, "beats": 0, "skipped": 0, "failures": {}, "max_gap_seconds": 0.0, "moved": 0}
    if args.run_tasks:
        stats |= {
            "claimed": 0,
            "claims_lost": 0,
            "claims_confirmed": 0,
            "completed": 0,
            "reports_retried": 0,
            "most_at_once": 0,
        }
    home = [n % len(ports) for n in range(args.nodes)]  # the instance each node talks to
    last_sent = [None] * args.nodes
    in_flight = [False] * args.nodes
    heard: set[int] = set()  # nodes whose beat the server has taken
    taken: list[set[int]] = [set() for _ in range(args.nodes)]  # tasks each node has claimed or tried
    running = [0] * args.nodes
    work: set[asyncio.Task] = set()
    session = aiohttp.ClientSession(headers={"X-API-Key": args.secret}) if args.run_tasks else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    async def send(n: int):
        if in_flight[n]:  # an agent beats again only once its last beat was answered
            stats["skipped"] += 1
            return
        in_flight[n] = True
        try:
            await beat(n)
        finally:
            in_flight[n] = False

    async def beat(n: int):
        now = loop.time()
        if last_sent[n] is not None:
            stats["max_gap_seconds"] = max(stats["max_gap_seconds"], now - last_sent[n])
        last_sent[n] = now
        at = home[n]
        pool = pools[at]
        conn = await pool.get()
        body = b""
        try:
            raw = requests[n] if busy is None else beat_request(busy.node_id(n), args.secret, busy.body(n))
            status, body = await conn.request(raw)
        except (OSError, asyncio.IncompleteReadError):
            status, conn = -1, Connection(ports[at])
        finally:
            pool.put_nowait(conn)
        stats["beats"] += 1
        if status == 200:
            heard.add(n)
            if session is not None:
                for task_id in orjson.loads(body).get("scheduled_tasks") or ():
                    if task_id not in taken[n]:
                        taken[n].add(task_id)
                        job = asyncio.ensure_future(run_task(n, task_id))
                        work.add(job)
                        job.add_done_callback(work.discard)
        else:
            stats["failures"][str(status)] = stats["failures"].get(str(status), 0) + 1
            if status == -1 and len(ports) > 1 and home[n] == at:
                home[n] = (at + 1) % len(ports)  # the load balancer takes it elsewhere
                stats["moved"] += 1

    async def put(n: int, task_id: int, body: dict, *, until_answered: bool) -> int:
        """PUT on the node's instance; a report is retried (failing over) until answered."""
        while True:
            url = args.url[home[n]].rstrip("/")
            try:
                async with session.put(
                    f"{url}/api/v1/tasks/{task_id}", json=body, timeout=aiohttp.ClientTimeout(total=30)
                ) as response:
                    if response.status < 500:
                        return response.status
            except (aiohttp.ClientError, TimeoutError):
                if len(ports) > 1:
                    home[n] = (home[n] + 1) % len(ports)
            if not until_answered or stop.is_set():
                return -1
            stats["reports_retried"] += 1
            await asyncio.sleep(1.0)

    async def claimed_here(n: int, task_id: int, node_id: str) -> bool:
        """After a claim whose answer was lost (a 5xx or no answer: the server may have
        applied it before failing), ask until answered whether the task runs here now."""
        while not stop.is_set():
            url = args.url[home[n]].rstrip("/")
            try:
                async with session.get(
                    f"{url}/api/v1/tasks/{task_id}",
                    params={"node_id": node_id},
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as response:
                    if response.status < 500:
                        return response.status == 200 and (await response.json()).get("status") == "running"
            except (aiohttp.ClientError, TimeoutError):
                if len(ports) > 1:
                    home[n] = (home[n] + 1) % len(ports)
            await asyncio.sleep(1.0)
        return False

    async def run_task(n: int, task_id: int):
        node_id = f"{args.prefix}-{n:05d}"
        claim = {"node_id": node_id, "from_status": "scheduled", "status": "running"}
        status = await put(n, task_id, claim, until_answered=False)
        if (status == -1 or status >= 500) and await claimed_here(n, task_id, node_id):
            stats["claims_confirmed"] += 1
            status = 200
        if status != 200:
            stats["claims_lost"] += 1
            taken[n].discard(task_id)  # listed again on a later beat if it is still ours
            return
        stats["claimed"] += 1
        running[n] += 1
        stats["most_at_once"] = max(stats["most_at_once"], running[n])
        try:
            await asyncio.sleep(args.run_tasks)
        finally:
            running[n] -= 1
        report = {"node_id": node_id, "from_status": "running", "status": "completed", "exit_code": 0}
        if await put(n, task_id, report, until_answered=True) == 200:
            stats["completed"] += 1

    started = loop.time()
    # first beats spread over one interval, as agents started at random times would be
    due = [(started + rng.uniform(0, args.interval), n) for n in range(args.nodes)]
    heapq.heapify(due)
    pending: set[asyncio.Task] = set()
    ready_marker = Path(args.ready_file) if args.ready_file else None
    while not stop.is_set() and (args.duration <= 0 or loop.time() - started < args.duration):
        at, n = heapq.heappop(due)
        delay = at - loop.time()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
                break
            except TimeoutError:
                pass
        task = asyncio.ensure_future(send(n))
        pending.add(task)
        task.add_done_callback(pending.discard)
        heapq.heappush(due, (at + args.interval * rng.uniform(1 - args.jitter, 1 + args.jitter), n))
        if ready_marker and len(heard) == args.nodes and not ready_marker.exists():
            ready_marker.write_text("registered\n")
    if pending:
        await asyncio.wait(pending, timeout=10)
    if work:  # reports of tasks still running are not sent: a fleet stopped is a fleet gone
        for job in work:
            job.cancel()
        await asyncio.wait(work, timeout=10)
    if session is not None:
        await session.close()
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", required=True, action="append", help="a control-plane instance, http://127.0.0.1:PORT (repeatable)"
    )
    parser.add_argument("--secret", required=True, help="the agent key")
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between a node's beats, on average")
    parser.add_argument("--jitter", type=float, default=0.2, help="each gap is interval × (1 ± jitter)")
    parser.add_argument("--duration", type=float, default=0, help="seconds; 0: until SIGTERM")
    parser.add_argument("--prefix", default="sim", help="node ids are <prefix>-00000 …")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--run-tasks", type=float, default=0, help="claim the tasks sent and complete them after S s")
    parser.add_argument("--ready-file", help="written once the server has taken a beat from every node")
    parser.add_argument(
        "--busy", action="store_true", help="readings that move every beat, as a busy fleet's do (bench/busy.py)"
    )
    args = parser.parse_args()
    if not 0 <= args.jitter < 1:
        parser.error("--jitter must be in [0, 1)")
    stats = asyncio.run(run(args))
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
