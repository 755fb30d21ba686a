"""Live-log ingestion load for bench/logs.py: simulated agents shipping their tasks' output
to POST /api/v1/nodes/{id}/logs as the agent does (agent/heteroflow_agent/logs.py).

The shape a busy fleet has: each node runs several tasks; each task writes lines of 20 to
300 characters (training progress, data-loader chatter, tracebacks, progress bars, mostly
stdout, some stderr), about `rate / tasks` bytes a second on average but in bursts (one
second in ten about 2.5 times the mean, the others below it, each second's volume drawn
around that); each node sends one gzip batch a second holding what each of its tasks
wrote that second, its lines numbered per run from where the last batch ended, and waits
for the answer before the next (the agent ships from one thread). A node that falls
behind (the answer came after its next batch was due) sends the next at once, batch
after batch, as an agent with a backlog does: offered more than the route takes, the
nodes turn into a closed loop of `nodes` connections, and what is answered is the
route's capacity.

Every batch is built and compressed (gzip, the agent's level 5 by default) before the
clock starts, in a process of its own (`run_child`, started by bench/logs.py), so that
during the measured window the generator only writes prepared bytes and reads answers:
it is not the bottleneck, and it does not share an event loop (or a GIL) with the
heartbeat generator it runs beside. It reports its own CPU time for the window.
"""

from __future__ import annotations

import asyncio
import gzip
import random
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import orjson

POOL_LINES = 16_384
TASK_BATCH_BYTES = 128 * 1024  # the agent's bound on one task's lines in one batch
BURST_EVERY = 10  # about one second in this many is a burst...
BURST_FACTOR = 2.5  # ...of this many times the mean
STDERR_SHARE = 0.1

TEMPLATES = (
    lambda r: (
        f"step {r.randrange(10**6)}/1000000 loss {r.random() * 4:.4f} lr {r.random() * 1e-3:.2e} "
        f"grad_norm {r.random() * 2:.3f} tokens/s {r.randrange(20000, 60000)} mem {r.random() * 80:.1f}GiB"
    ),
    lambda r: (
        f"[rank{r.randrange(64)}] INFO {r.randrange(24):02d}:{r.randrange(60):02d}:{r.randrange(60):02d} "
        f"dataloader: worker {r.randrange(16)} prefetched batch {r.randrange(10**5)}"
    ),
    lambda r: (
        f"Epoch {r.randrange(100)}: {r.randrange(100):3d}%|{'#' * r.randrange(30)}{' ' * r.randrange(10)}| "
        f"{r.randrange(5000)}/5000 [{r.randrange(60):02d}:{r.randrange(60):02d}<{r.randrange(60):02d}:"
        f"{r.randrange(60):02d}, {r.random() * 10:.2f}it/s]"
    ),
    lambda r: f"WARNING torch.distributed: NCCL watchdog heartbeat {r.randrange(10**4)} ms on nvidia{r.randrange(8)}",
    lambda r: (
        f'  File "/opt/conda/lib/python3.11/site-packages/torch/nn/modules/module.py", '
        f"line {r.randrange(2000)}, in _call_impl"
    ),
    lambda r: f"eval: accuracy={r.random():.5f} f1={r.random():.5f} samples={r.randrange(10**5)}",
    lambda r: (
        f"checkpoint saved to /data/ckpt/run-{r.randrange(10**6)}/model_{r.randrange(10**4)}.safetensors "
        f"({r.randrange(10**9)} bytes)"
    ),
)


def text_pool(seed: int, size: int = POOL_LINES) -> list[str]:
    """Log lines of 20-300 characters (uniform), built from the templates above."""
    rnd = random.Random(seed)
    pool = []
    for _ in range(size):
        length = rnd.randint(20, 300)
        text = rnd.choice(TEMPLATES)(rnd)
        while len(text) < length:
            text += " " + rnd.choice(TEMPLATES)(rnd)
        pool.append(text[:length])
    return pool


def log_request(node_id: str, secret: str, body: bytes) -> bytes:
    return (
        f"POST /api/v1/nodes/{node_id}/logs HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: {secret}\r\n"
        f"Content-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


@dataclass
class Prepared:
    """One node's batches, one a second: the raw requests and what each carries."""

    node_id: str
    requests: list[bytes] = field(default_factory=list)
    text_bytes: list[int] = field(default_factory=list)  # the lines' text, uncompressed (UTF-8)
    lines: list[int] = field(default_factory=list)
    compressed: list[int] = field(default_factory=list)


def second_volumes(rnd: random.Random, mean: float, seconds: int) -> list[float]:
    """Bytes one task writes in each second: bursts one second in BURST_EVERY, quieter
    otherwise, each drawn ±25 % around its level; the mean over many seconds is `mean`."""
    quiet = (1 - BURST_FACTOR / BURST_EVERY) / (1 - 1 / BURST_EVERY)
    return [
        mean * (BURST_FACTOR if rnd.randrange(BURST_EVERY) == 0 else quiet) * rnd.uniform(0.75, 1.25)
        for _ in range(seconds)
    ]


def prepare(spec: dict) -> tuple[list[Prepared], float]:
    """Every node's batches for spec["seconds"] seconds, each task's lines numbered on
    from spec["next_n"]; (the batches, seconds spent)."""
    started = time.perf_counter()
    rnd = random.Random(spec["seed"])
    pool = text_pool(spec["seed"])
    # the order lines are drawn in (and their streams), cycled through by every task
    order = [rnd.randrange(POOL_LINES) for _ in range(1 << 17)]
    texts = [pool[i] for i in order]
    sizes = [len(text.encode()) for text in texts]
    streams = ["stderr" if rnd.random() < STDERR_SHARE else "stdout" for _ in order]
    cycle = len(order)
    seconds = spec["seconds"]
    mean = spec["rate_bytes"] / max(1, sum(len(tasks) for tasks in spec["nodes"].values()))
    next_n = dict(spec["next_n"])
    t0 = spec["at_start"]
    prepared = []
    pending = []
    level = spec["gzip_level"]
    # zlib lets go of the GIL: batches are compressed on the other cores while the next
    # ones are built (nothing is measured yet)
    with ThreadPoolExecutor(max_workers=spec.get("threads", 2)) as compressors:
        for node_id, tasks in spec["nodes"].items():
            node = Prepared(node_id)
            prepared.append(node)
            volumes = [second_volumes(rnd, mean, seconds) for _ in tasks]
            cursor = rnd.randrange(cycle)
            for k in range(seconds):
                items, text_bytes, count = [], 0, 0
                for task, volume in zip(tasks, volumes, strict=True):
                    want = min(volume[k], TASK_BATCH_BYTES)
                    lines, size, n = [], 0, next_n.get(task, 0)
                    start = t0 + k - 1  # read by the agent over the second before the batch
                    while size < want:
                        cursor = cursor + 1 if cursor + 1 < cycle else 0
                        lines.append([n, round(start + size / want, 6), streams[cursor], texts[cursor]])
                        size += sizes[cursor]
                        n += 1
                    next_n[task] = n
                    items.append({"task_id": task, "run": spec["run"], "dropped_bytes": 0, "lines": lines})
                    text_bytes += size
                    count += len(lines)
                node.text_bytes.append(text_bytes)
                node.lines.append(count)
                body = orjson.dumps({"tasks": items})
                pending.append((node, compressors.submit(gzip.compress, body, compresslevel=level)))
        for node, future in pending:
            body = future.result()
            node.requests.append(log_request(node.node_id, spec["secret"], body))
            node.compressed.append(len(body))
    return prepared, time.perf_counter() - started


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def send_all(spec: dict, prepared: list[Prepared], Conn) -> dict:
    """Each node sends batch k at t0 + k + its phase, or at once when it is behind; the
    window is [warmup, warmup + duration) seconds after t0: batches due in it are
    measured, and none is sent after it ends (those due but not sent by then are the
    backlog)."""
    loop = asyncio.get_running_loop()
    warmup, duration = spec["warmup"], spec["duration"]
    t0 = loop.time() + 0.2
    window_start, window_end = t0 + warmup, t0 + warmup + duration
    latencies: list[float] = []
    lags: list[float] = []  # answer − due, for measured batches: how far behind the fleet is
    errors: dict[int, int] = {}
    done = {"batches": 0, "bytes": 0, "lines": 0, "compressed": 0}
    acked: dict[int, int] = {}  # each task's next n, as the store answered
    refused: set[int] = set()
    nodes = len(prepared)
    due_in_window = sent_in_window = 0

    async def node_loop(index: int, node: Prepared):
        nonlocal due_in_window, sent_in_window
        conn = Conn(spec["port"])
        phase = index / nodes
        for k, raw in enumerate(node.requests):
            due = t0 + k + phase
            if due >= window_end:
                break
            if due >= window_start:
                due_in_window += 1
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if loop.time() >= window_end:
                continue  # behind: counted as due, not sent
            if due >= window_start:
                sent_in_window += 1
            sent = loop.time()
            try:
                status, body = await asyncio.wait_for(conn.request(raw), 60)
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError):
                status, body = -1, b""
                if conn.writer is not None:
                    conn.writer.close()
                conn = Conn(spec["port"])
            answered = loop.time()
            if status == 200:
                answer = orjson.loads(body)
                refused.update(answer.get("refused") or ())
                for task, next_n in (answer.get("tasks") or {}).items():
                    acked[int(task)] = max(acked.get(int(task), 0), next_n)
            if due < window_start:
                continue  # warm-up
            latencies.append(answered - sent)
            lags.append(answered - due)
            if status != 200:
                errors[status] = errors.get(status, 0) + 1
            elif answered <= window_end:
                done["batches"] += 1
                done["bytes"] += node.text_bytes[k]
                done["lines"] += node.lines[k]
                done["compressed"] += node.compressed[k]
        conn.close()

    senders = asyncio.gather(*(node_loop(i, node) for i, node in enumerate(prepared)))
    await asyncio.sleep(max(0.0, window_start - loop.time()))
    cpu_start = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.sleep(max(0.0, window_end - loop.time()))
    cpu_end = resource.getrusage(resource.RUSAGE_SELF)
    await senders  # the answers to batches sent before the end
    cpu = (cpu_end.ru_utime + cpu_end.ru_stime) - (cpu_start.ru_utime + cpu_start.ru_stime)
    return {
        "duration": duration,
        "batches": done["batches"],
        "bytes": done["bytes"],
        "lines": done["lines"],
        "compressed": done["compressed"],
        "due": due_in_window,
        "unsent": due_in_window - sent_in_window,
        "measured": len(latencies),
        "p50": percentile(latencies, 0.5),
        "p99": percentile(latencies, 0.99),
        "max": max(latencies, default=float("nan")),
        "lag_p50": percentile(lags, 0.5),
        "lag_p99": percentile(lags, 0.99),
        "errors": errors,
        "refused": sorted(refused),
        "cpu_seconds": cpu,
        "acked": acked,
    }


def run_child(pipe, spec: dict) -> None:
    """The generator's process: prepare, say so, wait for "go", send, report."""
    import sys

    sys.path.insert(0, spec["repo"])
    from bench.soak import Conn

    try:
        spec["at_start"] = time.time() + spec.get("start_in", 0.0)
        prepared, seconds = prepare(spec)
        raw = sum(sum(node.text_bytes) for node in prepared)
        packed = sum(sum(node.compressed) for node in prepared)
        pipe.send(("ready", {"build_seconds": seconds, "text_bytes": raw, "compressed": packed}))
        if pipe.recv() != "go":
            return
        result = asyncio.run(send_all(spec, prepared, Conn))
        # where each task's numbering goes on: what the store took (lines built but
        # never sent are not numbered twice, and leave no gap)
        tasks = [task for ids in spec["nodes"].values() for task in ids]
        result["next_n"] = {task: result["acked"].get(task, spec["next_n"].get(task, 0)) for task in tasks}
        pipe.send(("done", result))
    except BaseException as exc:  # noqa: BLE001  (said to the parent, which reports it)
        pipe.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise
