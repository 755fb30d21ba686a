"""Scheduler processes for the concurrency proofs: each its own Python process and
database connection, all released at the same moment, cycling until the queue stops
moving (three idle cycles)."""

import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

from django.db import connection

REPO = Path(__file__).resolve().parents[2]

SCHEDULER = r"""
import sys, time
import django
django.setup()
from apps.scheduler.services import run_cycle
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.005)
idle = 0
while idle < 3:
    result = run_cycle()
    idle = idle + 1 if not result.bound and not result.lost_races else 0
print("done", flush=True)
"""


def database_url() -> str:
    """The test database's URL, for the child processes."""
    db = connection.settings_dict
    host = db["HOST"] or "localhost"
    if host.startswith("/"):
        return f"postgresql://{db['USER']}@{quote(host, safe='')}/{db['NAME']}"
    return f"postgresql://{db['USER']}@{host}:{db['PORT'] or 5432}/{db['NAME']}"


def start_schedulers(count: int = 4, delay: float = 3.0, script: str = SCHEDULER) -> list[subprocess.Popen]:
    """`count` scheduler processes that start cycling together `delay` seconds from now
    (`script`: what each runs, given the start time as its argument)."""
    env = dict(os.environ, DATABASE_URL=database_url())
    start = time.time() + delay
    return [
        subprocess.Popen(
            [sys.executable, "-c", script, str(start)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]


def race(check, count: int = 4, script: str = SCHEDULER) -> tuple[int, list]:
    """Run `count` schedulers together to the end, calling `check` (a list of what is
    wrong now) every 50 ms meanwhile. Returns how many samples were taken and every
    non-empty answer seen; a scheduler that fails fails the test with its stderr."""
    schedulers = start_schedulers(count, script=script)
    samples, seen = 0, []
    while any(process.poll() is None for process in schedulers):
        if wrong := check():
            seen.append(wrong)
        samples += 1
        time.sleep(0.05)
    for process in schedulers:
        out, err = process.communicate()
        assert process.returncode == 0 and "done" in out, err[-2000:]
    return samples, seen


def over_capacity() -> list:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT a.node_id, a.gpu_index, count(*) FROM gpu_allocations a WHERE a.memory_mb IS NULL "
            "GROUP BY a.node_id, a.gpu_index HAVING count(*) > 1"
        )
        doubled = cursor.fetchall()
        cursor.execute(
            "SELECT t.id FROM tasks t LEFT JOIN gpu_allocations a ON a.task_id = t.id "
            "GROUP BY t.id, t.gpu_required, t.status HAVING count(a.id) > t.gpu_required "
            "OR count(DISTINCT a.node_id) > 1"
        )
        return doubled + cursor.fetchall()
