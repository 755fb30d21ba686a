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


def start_schedulers(count: int = 4, delay: float = 3.0) -> list[subprocess.Popen]:
    """`count` scheduler processes that start cycling together `delay` seconds from now."""
    env = dict(os.environ, DATABASE_URL=database_url())
    start = time.time() + delay
    return [
        subprocess.Popen([sys.executable, "-c", SCHEDULER, str(start)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
