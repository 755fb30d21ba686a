"""The storm: every writer of node and card rows at once, loaded as a busy fleet loads them.

A simulated fleet of NODES nodes beats as fast as it can (each node's next beat is due
almost at once, so the connections never rest), with readings that move every beat
(memory, power, utilisation; now and then a card's health counters: bench/busy.py), and
works the tasks sent to it on the real task channel. At the same time every periodic job
runs back to back in a loop (`manage.py run_jobs`: the health check, the alert sweep, the
energy rollup, the clean period, the slices' GC…, the scheduler's tick and its binds
among them), beat and a worker run them on their real periods too, and tasks are created
through the API all along.

The control plane's PostgreSQL is a server of this test's own with lock waits logged
(`log_lock_waits`, `deadlock_timeout` 200 ms), so a writer that takes rows in another
order than the beats (docs/architecture.md#lock-order) shows up as waits, and as
deadlocks. The test fails on any answer that is not 200/201, any job run that failed,
any deadlock (`pg_stat_database.deadlocks`), any lock wait over 1 s, any beat that waited
past deadlock_timeout for a card row (only a writer of many cards in another order than
the beats holds them that long), and any beat seen waiting (sampled every 10 ms) on a
periodic job other than the two that take node rows in the beats' order; it prints every
wait the server logged and every job a beat was seen waiting on.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import psycopg
import pytest
import redis
import requests
from django.conf import settings

from tests.faults.cluster import ControlPlane, Fleet
from tests.headers import bearer_http
from tests.live import REPO

pytestmark = [pytest.mark.e2e]

NODES = 1000
STORM_SECONDS = 40.0
BEAT_EVERY = 0.25  # each node's next beat is due this soon: far more than the server takes
TASKS_PER_SECOND = 2.0
WAIT_LIMIT_MS = 1000.0

# log_lock_waits: "process 123 still waiting for ShareLock on transaction 456 after 200.1 ms"
# when deadlock_timeout passes, "process 123 acquired … after 1203.4 ms" when it got it.
WAIT_LINE = re.compile(r"process \d+ (still waiting for|acquired) .* after (?P<ms>[\d.]+) ms")
# A beat's own card rows are written by nothing else for long: its health step follows it in
# the same request, an operator's cordon takes one card, sweeps skip what a beat holds. A
# beat that waited past deadlock_timeout for a card row met a writer that holds many cards
# in another order (the drift sweep that deadlocked did exactly this).
BEAT_WAITED_FOR_A_CARD = re.compile(r'relation "gpus".*STATEMENT: +WITH node AS \(')


def configure_lock_logging(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET log_lock_waits = on")
        conn.execute("ALTER SYSTEM SET deadlock_timeout = '200ms'")
        conn.execute("SELECT pg_reload_conf()")
    # pg_reload_conf() only signals the postmaster: a session started before it has read
    # the file again still has the old values
    deadline = time.monotonic() + 30
    while True:
        with psycopg.connect(url) as conn:
            if conn.execute("SHOW deadlock_timeout").fetchone() == ("200ms",):
                return
        assert time.monotonic() < deadline, "the server did not take deadlock_timeout = 200ms"
        time.sleep(0.1)


def deadlocks(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()").fetchone()[0]


def logged_waits(log_text: str) -> list[tuple[float, str]]:
    """Each lock wait the server logged, (ms, the line and the statement that waited)."""
    lines = log_text.splitlines()
    waits = []
    for number, line in enumerate(lines):
        match = WAIT_LINE.search(line)
        if match:
            context = " | ".join(text.strip()[:200] for text in lines[number + 1 : number + 4])
            waits.append((float(match["ms"]), f"{line.strip()[:300]} | {context}"))
    return waits


# Beats waiting on a lock, with the periodic job whose transaction holds it (the guard names
# a job's transaction `job:<name>`, apps.core.guard).
BLOCKED_BEATS = """
    SELECT b.application_name, left(b.query, 120)
    FROM pg_stat_activity AS w, unnest(pg_blocking_pids(w.pid)) AS holder(pid), pg_stat_activity AS b
    WHERE b.pid = holder.pid AND w.datname = current_database() AND w.wait_event_type = 'Lock'
      AND w.query LIKE 'WITH node AS (%%' AND b.application_name LIKE 'job:%%'
"""
# The jobs that may make a beat wait, briefly: they lock node rows only, in the beats'
# order (docs/architecture.md#lock-order): the scheduler's bind, and the health check's
# silent nodes. A job that holds card rows a beat needs takes them across the fleet.
MAY_HOLD_A_BEAT = {"job:scheduler.tick", "job:nodes.check_health"}


class BlockSampler(threading.Thread):
    """Every few milliseconds: which periodic jobs hold a lock a beat is waiting for. Lock
    waits too short for the server's log (under deadlock_timeout) are seen here."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.blockers: dict[str, int] = {}
        self.statements: dict[str, str] = {}
        self.samples = 0
        self.done = threading.Event()

    def run(self):
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.done.wait(0.01):
                for job, statement in conn.execute(BLOCKED_BEATS).fetchall():
                    self.blockers[job] = self.blockers.get(job, 0) + 1
                    self.statements.setdefault(job, statement)
                self.samples += 1


class TaskCreator(threading.Thread):
    """Tasks created through the API at TASKS_PER_SECOND until stopped; every answer kept."""

    def __init__(self, url: str, key: str):
        super().__init__(daemon=True)
        self.url, self.headers = url, bearer_http(key)
        self.statuses: dict[int, int] = {}
        self.done = threading.Event()

    def run(self):
        number = 0
        while not self.done.wait(1 / TASKS_PER_SECOND):
            body = {"tenant": "lab", "name": f"storm-{number}", "image": "busybox", "gpu_required": 1}
            try:
                status = requests.post(
                    f"{self.url}/api/v1/tasks", json=body, headers=self.headers, timeout=30
                ).status_code
            except requests.RequestException:
                status = -1
            self.statuses[status] = self.statuses.get(status, 0) + 1
            number += 1


def test_the_storm(tmp_path, own_postgres):
    server, _socket_dir, url, key = own_postgres
    configure_lock_logging(url)
    redis.Redis.from_url(settings.REDIS_URL).delete("celery")
    plane = ControlPlane(tmp_path, DATABASE_URL=url).start()
    fleet = Fleet(plane.url, tmp_path, nodes=NODES, prefix="storm", interval=BEAT_EVERY, run_tasks=2.0, busy=True)
    creator = TaskCreator(plane.url, key)
    sampler = BlockSampler(url)
    operator = bearer_http(key)
    try:
        fleet.wait_registered()
        assert requests.post(f"{plane.url}/api/v1/tenants", json={"name": "Lab", "slug": "lab"}, headers=operator).ok
        # busy readings go up to 100 % utilisation: let the scheduler place on any card,
        # so binds (which lock node rows) happen all through the storm
        loose = {
            "extra": {
                name: 100
                for name in (
                    "cpu_percent_max",
                    "memory_percent_max",
                    "gpu_memory_percent_max",
                    "gpu_utilization_max",
                    "gpu_temperature_max",
                )
            }
        }
        assert requests.put(f"{plane.url}/api/v1/plugins/resource-filter", json=loose, headers=operator).ok
        log_offset = server.log.stat().st_size
        deadlocks_before = deadlocks(url)
        creator.start()
        sampler.start()
        jobs = subprocess.run(
            [sys.executable, "manage.py", "run_jobs", "--seconds", str(STORM_SECONDS)],
            cwd=REPO,
            env=plane.env,
            capture_output=True,
            text=True,
            timeout=STORM_SECONDS + 300,
        )
        creator.done.set()
        sampler.done.set()
        creator.join(timeout=60)
        sampler.join(timeout=60)
        figures = fleet.finish(timeout=0.1)
        time.sleep(1.0)  # the statistics collector reports deadlocks with a short delay
        deadlocks_after = deadlocks(url)
        with open(server.log, errors="replace") as log:
            log.seek(log_offset)
            waits = logged_waits(log.read())
    finally:
        creator.done.set()
        sampler.done.set()
        fleet.kill()
        plane.stop()

    summary = json.loads(jobs.stdout.strip().splitlines()[-1]) if jobs.stdout.strip() else {}
    print(f"\nstorm: {NODES} busy nodes for {STORM_SECONDS:.0f} s; fleet {figures}")
    print(f"task creates by status: {creator.statuses}; deadlocks {deadlocks_before} -> {deadlocks_after}")
    for name, job in sorted(summary.items()):
        print(f"  {name:<38} {job['outcomes']} mean {job['mean_seconds']} s, max {job['max_seconds']} s")
    print(f"beats seen waiting on a job's locks ({sampler.samples} samples): {sampler.blockers}")
    for job, statement in sampler.statements.items():
        print(f"  {job}: {statement}")
    print(f"lock waits logged (over 200 ms): {len(waits)}")
    for ms, line in waits:
        print(f"  {ms:>9.1f} ms  {line}")

    assert jobs.returncode == 0, f"a periodic job failed under the storm:\n{jobs.stdout[-3000:]}\n{jobs.stderr[-5000:]}"
    assert figures["beats"] > NODES * 10, figures  # the storm was one
    assert figures["failures"] == {}, f"heartbeats not answered 200: {figures}\n{plane.logs()}"
    assert set(creator.statuses) == {201}, f"task creates not answered 201: {creator.statuses}\n{plane.logs()}"
    assert figures["claimed"] > 0, figures  # binds happened all along
    assert deadlocks_after == deadlocks_before, f"{deadlocks_after - deadlocks_before} deadlocks\n{plane.logs()}"
    assert not [line for ms, line in waits if ms > WAIT_LIMIT_MS], "a lock wait over 1 s (above)"
    assert not [line for ms, line in waits if BEAT_WAITED_FOR_A_CARD.search(line)], "a beat waited for a card (above)"
    assert set(sampler.blockers) <= MAY_HOLD_A_BEAT, f"a periodic job made beats wait: {sampler.blockers}"
