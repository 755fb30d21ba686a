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

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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
    port = int(args.url.rsplit(":", 1)[1].rstrip("/"))
    requests = payloads(args)
    rng = random.Random(args.seed)
    pool: asyncio.Queue[Connection] = asyncio.Queue()
    for _ in range(args.connections):
        pool.put_nowait(Connection(port))
    stats = {"nodes": args.nodes, "beats": 0, "failures": {}, "max_gap_seconds": 0.0}
    last_sent = [None] * args.nodes
    heard: set[int] = set()  # nodes whose beat the server has taken
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    async def send(n: int):
        now = loop.time()
        if last_sent[n] is not None:
            stats["max_gap_seconds"] = max(stats["max_gap_seconds"], now - last_sent[n])
        last_sent[n] = now
        conn = await pool.get()
        try:
            status, _ = await conn.request(requests[n])
        except (OSError, asyncio.IncompleteReadError):
            status, conn = -1, Connection(port)
        finally:
            pool.put_nowait(conn)
        stats["beats"] += 1
        if status == 200:
            heard.add(n)
        else:
            stats["failures"][str(status)] = stats["failures"].get(str(status), 0) + 1

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
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the control plane, http://127.0.0.1:PORT")
    parser.add_argument("--secret", required=True, help="the agent key")
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between a node's beats, on average")
    parser.add_argument("--jitter", type=float, default=0.2, help="each gap is interval × (1 ± jitter)")
    parser.add_argument("--duration", type=float, default=0, help="seconds; 0: until SIGTERM")
    parser.add_argument("--prefix", default="sim", help="node ids are <prefix>-00000 …")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ready-file", help="written once the server has taken a beat from every node")
    args = parser.parse_args()
    if not 0 <= args.jitter < 1:
        parser.error("--jitter must be in [0, 1)")
    stats = asyncio.run(run(args))
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
