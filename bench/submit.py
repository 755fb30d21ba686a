"""Submission benchmark: task creates through the real HTTP API, the server served as
`make up` serves it (uvicorn, one process, production settings, PostgreSQL, Redis as the
broker), one tenant that already has 10,000 active tasks (and a quota, so every create
checks it).

- single: POST /api/v1/tasks from 4 concurrent clients (keep-alive connections) for a
  few seconds: creates per second and the latency;
- batch: POST /api/v1/tasks/batch with `array: {count: 1000}`, one after another: tasks
  per second.

    make bench-submit
    .venv/bin/python bench/submit.py --clients 4 --duration 10 --batch 1000 --batches 10

Uses DATABASE_URL / REDIS_URL when set, else starts the embedded pair in a scratch
folder. Works in a database of its own, heteroflow_bench_submit, dropped before and
after. No Celery worker runs: the scheduler cycles the creates ask for wait in Redis,
as they are sent either way. Prints figures and, for each target, PASS or FAIL (the exit
status stays 0: on a shared machine a figure is a measurement, not a verdict on the code).
"""

from __future__ import annotations

import argparse
import http.client
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.heartbeats import percentile, server_env, start_server, stores_in_use, with_database  # noqa: E402
from heteroflow.embedded import ensure_data_stores  # noqa: E402

DB_NAME = "heteroflow_bench_submit"
TENANT = "bench"
BODY = {
    "tenant": TENANT,
    "name": "sweep",
    "image": "registry.local/sweep:1",
    "command": ["python", "run.py"],
    "env": {"LR": "0.1"},
    "gpu_required": 1,
    "gpu_memory_mb": 16_000,
    "labels": {"team": "bench"},
}

SETUP = r"""
import sys, django
django.setup()
from django.contrib.auth import get_user_model
from apps.tasks.services import create_tasks
from apps.tenants.services import create_tenant, issue_platform_key
tenant = create_tenant(name="Bench", slug=sys.argv[1], max_concurrent_tasks=10_000_000, max_gpus=10_000_000)
spec = {"name": "existing", "image": "x", "gpu_required": 1, "timeout_seconds": 3600}
for _ in range(int(sys.argv[2]) // 1000):
    create_tasks(tenant, [spec] * 1000)
user = get_user_model().objects.create_superuser("bench", "bench@example.test", "x")
print(issue_platform_key(user=user, name="bench").key)
"""


SINGLE_TARGET = 200  # creates per second, 4 clients (issue 15)
BATCH_TARGET = 2_000  # tasks per second through the batch form


def verdict(what: str, value: float, target: float, unit: str, *, exact: bool = False) -> str:
    passed = value == target if exact else value >= target
    relation = "==" if exact else ">="
    return f"  {'PASS' if passed else 'FAIL'}  {what}: {value:,.0f}{unit} ({relation} {target:,}{unit})"


def say(message: str) -> None:
    print(message, flush=True)


def post(conn: http.client.HTTPConnection, path: str, body: bytes, key: str) -> tuple[int, bytes]:
    conn.request(
        "POST", path, body=body, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    )
    response = conn.getresponse()
    return response.status, response.read()


def single_creates(port: int, key: str, clients: int, duration: float) -> tuple[int, float, list[float], dict]:
    body = orjson.dumps(BODY)
    latencies: list[float] = []
    errors: dict[int, int] = {}
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    stop_at = [0.0]

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", port)
        for _ in range(5):  # warm-up: connection, the server's first requests
            post(conn, "/api/v1/tasks", body, key)
        start.wait()
        mine, failed = [], {}
        while time.perf_counter() < stop_at[0]:
            began = time.perf_counter()
            status, _ = post(conn, "/api/v1/tasks", body, key)
            mine.append(time.perf_counter() - began)
            if status != 201:
                failed[status] = failed.get(status, 0) + 1
        with lock:
            latencies.extend(mine)
            for status, n in failed.items():
                errors[status] = errors.get(status, 0) + n

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    stop_at[0] = time.perf_counter() + duration + 0.5
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return len(latencies), time.perf_counter() - began, latencies, errors


def batches(port: int, key: str, size: int, count: int) -> tuple[int, float, list[float], dict]:
    body = orjson.dumps(BODY | {"array": {"count": size}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    post(conn, "/api/v1/tasks/batch", orjson.dumps(BODY | {"array": {"count": 10}}), key)  # warm-up
    latencies, errors, created = [], {}, 0
    began = time.perf_counter()
    for _ in range(count):
        t = time.perf_counter()
        status, answer = post(conn, "/api/v1/tasks/batch", body, key)
        latencies.append(time.perf_counter() - t)
        if status == 201:
            created += orjson.loads(answer)["count"]
        else:
            errors[status] = errors.get(status, 0) + 1
    return created, time.perf_counter() - began, latencies, errors


def active_tasks(database_url: str) -> tuple[int, int]:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        scanned = conn.execute(
            "SELECT count(*) FROM tasks WHERE status <> ALL (%s)", [["completed", "failed", "cancelled", "stopped"]]
        ).fetchone()[0]
        counted = conn.execute("SELECT coalesce(sum(tasks), 0) FROM tenant_usage").fetchone()[0]
    return scanned, counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--existing", type=int, default=10_000, help="active tasks in the tenant before (multiple of 1,000)"
    )
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of single creates")
    parser.add_argument("--batch", type=int, default=1000, help="tasks per batch request")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (make up runs one)")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="hf-bench-submit-"))
    (scratch / "static").mkdir()
    stores = ensure_data_stores(scratch, os.environ)
    admin_url = stores.database_url
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB_NAME}")
    database_url = with_database(admin_url, DB_NAME)
    env = server_env(database_url, stores.redis_url, scratch, secrets.token_urlsafe(24))
    server = None
    try:
        subprocess.run(
            [sys.executable, "manage.py", "migrate_schemas", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True
        )
        key = (
            subprocess.run(
                [sys.executable, "-c", SETUP, TENANT, str(args.existing)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        server, port = start_server(env, args.workers)
        where = stores_in_use(stores)
        say(
            f"server: uvicorn, {args.workers} process(es), production settings; data stores: {where}; "
            f"machine: {os.cpu_count()} cores; tenant '{TENANT}' with {active_tasks(database_url)[0]} active tasks"
        )

        done, elapsed, latencies, errors = single_creates(port, key, args.clients, args.duration)
        say(f"\n== single creates: POST /api/v1/tasks, {args.clients} clients, {elapsed:.1f} s ==")
        single_rate = done / elapsed
        say(f"  creates              {done} = {single_rate:.0f}/s (target >= {SINGLE_TARGET}/s)")
        say(
            f"  latency              p50 {percentile(latencies, 0.5) * 1000:.1f} ms, "
            f"p99 {percentile(latencies, 0.99) * 1000:.1f} ms"
        )
        say(f"  errors               {sum(errors.values())} {errors or ''}")

        created, elapsed, latencies, errors = batches(port, key, args.batch, args.batches)
        say(f"\n== batches: POST /api/v1/tasks/batch, array of {args.batch}, {args.batches} in a row ==")
        batch_rate = created / elapsed
        say(f"  tasks                {created} in {elapsed:.1f} s = {batch_rate:.0f}/s (target >= {BATCH_TARGET:,}/s)")
        say(
            f"  per batch            p50 {percentile(latencies, 0.5) * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms"
        )
        say(f"  errors               {sum(errors.values())} {errors or ''}")
        scanned, counted = active_tasks(database_url)
        say(f"\n  active tasks after   {scanned} (counted by tenant_usage: {counted})")
        say("")
        say(verdict("single creates", single_rate, SINGLE_TARGET, "/s"))
        say(verdict("batch tasks", batch_rate, BATCH_TARGET, "/s"))
        say(verdict("counter equals a count", counted, scanned, "", exact=True))
        return 0
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        stores.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
