"""`manage.py run_jobs --seconds N`: every periodic job, back to back, for N seconds.

Each job runs as beat's tick would run it, through its Celery task and the guard, but on
demand (`immediate`: not held back by its period, still never two at once). What beat
spreads over minutes comes here all at once, which is what the storm test
(tests/faults/test_storm.py) and a hand-run load check want: every writer of the database
busy while heartbeats, binds and task creates go on. Prints one JSON line at the end: per
job, its runs by outcome, mean and max seconds. Exits 1 if any run failed.
"""

from __future__ import annotations

import json
import time

from celery import current_app
from django.core.management.base import BaseCommand

from apps.core.guard import Outcome, declared_jobs


class Command(BaseCommand):
    help = "Run every periodic job back to back for --seconds (a load check), then print a JSON summary."

    def add_arguments(self, parser):
        parser.add_argument("--seconds", type=float, required=True, help="how long to keep running them")
        parser.add_argument("--only", action="append", default=[], help="a job name (repeatable); default: all")

    def handle(self, *args, seconds: float, only: list[str], **options):
        if seconds <= 0:
            self.stderr.write("--seconds must be more than 0")
            raise SystemExit(2)
        jobs = declared_jobs()
        unknown = sorted(set(only) - set(jobs))
        if unknown:
            self.stderr.write(f"no such periodic job: {', '.join(unknown)} (known: {', '.join(sorted(jobs))})")
            raise SystemExit(2)
        names = sorted(only or jobs)
        summary = {name: {"outcomes": {}, "total_seconds": 0.0, "max_seconds": 0.0} for name in names}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for name in names:
                started = time.monotonic()
                outcome = str(current_app.tasks[name](immediate=True))
                took = time.monotonic() - started
                figures = summary[name]
                figures["outcomes"][outcome] = figures["outcomes"].get(outcome, 0) + 1
                figures["total_seconds"] += took
                figures["max_seconds"] = max(figures["max_seconds"], took)
        for figures in summary.values():
            runs = sum(figures["outcomes"].values())
            figures["mean_seconds"] = round(figures.pop("total_seconds") / runs, 4) if runs else None
            figures["max_seconds"] = round(figures["max_seconds"], 4)
        self.stdout.write(json.dumps(summary, sort_keys=True))
        if any(figures["outcomes"].get(Outcome.FAILED) for figures in summary.values()):
            raise SystemExit(1)
