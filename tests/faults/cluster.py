"""Real processes for the fault tests: a simulated fleet (bench/fleet.py) sending
heartbeats over HTTP, and a whole control plane (web, Celery worker, Celery beat) that can
be killed and started again. Modules using these need `django_db(transaction=True)`."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from django.conf import settings
from django.db.models import Count

from apps.core.guard import EARLY_FRACTION, declared_jobs
from apps.core.models import JobRun
from apps.tasks.models import Task
from heteroflow.launcher import web_command
from tests.headers import bearer_http
from tests.live import REPO, free_port, server_env, stop_process, wait_for_web, wait_until


class Fleet:
    """`nodes` simulated nodes with `prefix`-NNNNN ids, beating until stopped: to one
    control plane, or spread over several (`url` a list; a node whose instance stops
    answering moves to the next). `run_tasks` seconds: they also claim the tasks sent to
    them and report them completed after that long (bench/fleet.py). `busy`: readings that
    move every beat (bench/busy.py)."""

    def __init__(
        self,
        url: str | list[str],
        log_dir: Path,
        *,
        nodes: int,
        prefix: str,
        interval: float = 5.0,
        jitter: float = 0.2,
        duration: float = 0,
        run_tasks: float = 0,
        busy: bool = False,
        connections: int = 32,
    ):
        urls = [url] if isinstance(url, str) else list(url)
        self.log_path = log_dir / f"fleet-{prefix}.log"
        self.ready = log_dir / f"fleet-{prefix}.ready"
        self.ready.unlink(missing_ok=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "bench/fleet.py",
                    *(arg for one in urls for arg in ("--url", one)),
                    "--run-tasks",
                    str(run_tasks),
                    "--secret",
                    settings.HETEROFLOW_AGENT_SECRET,
                    "--nodes",
                    str(nodes),
                    "--prefix",
                    prefix,
                    "--interval",
                    str(interval),
                    "--jitter",
                    str(jitter),
                    "--duration",
                    str(duration),
                    "--ready-file",
                    str(self.ready),
                    "--connections",
                    str(connections),
                    *(["--busy"] if busy else []),
                ],
                cwd=REPO,
                env=os.environ,
                start_new_session=True,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )

    def wait_registered(self, timeout: float = 120) -> None:
        wait_until(lambda: self.ready.exists() or self.process.poll() is not None, timeout, "the fleet's first beats")
        assert self.process.poll() is None, self.log_path.read_text()

    def kill(self) -> None:
        """A rack losing power: no farewell, no last beat."""
        stop_process(self.process, signal.SIGKILL)

    def finish(self, timeout: float = 120) -> dict:
        """Stop it (or wait for its --duration) and return its figures."""
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_process(self.process)
        lines = [line for line in self.log_path.read_text().splitlines() if line.startswith("{")]
        assert lines, self.log_path.read_text()
        return json.loads(lines[-1])


class ControlPlane:
    """uvicorn, a Celery worker and Celery beat on the test database, as `make up` runs
    them; `restart()` kills all three without warning and starts them again."""

    def __init__(self, log_dir: Path, **settings_env: str):
        self.log_dir, self.port = log_dir, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = server_env(**settings_env)
        self.processes: dict[str, subprocess.Popen] = {}
        self.starts = 0

    def start(self) -> ControlPlane:
        self.starts += 1
        for name, argv in self.commands().items():
            with open(self.log_dir / f"{name}-{self.starts}.log", "w") as log:
                self.processes[name] = subprocess.Popen(
                    argv, cwd=REPO, env=self.env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
                )
        wait_for_web(self.url)
        return self

    def commands(self) -> dict[str, list[str]]:
        """Each process's name and command line (a subclass may run others)."""
        python = sys.executable
        return {
            "web": web_command("127.0.0.1", self.port, "--log-level", "warning"),
            "worker": [
                python,
                "-m",
                "celery",
                "-A",
                "celery_worker",
                "worker",
                "--pool",
                "solo",
                "--loglevel",
                "WARNING",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
            ],
            "beat": [
                python,
                "-m",
                "celery",
                "-A",
                "celery_worker",
                "beat",
                "--loglevel",
                "WARNING",
                "--schedule",
                str(self.log_dir / f"beat-schedule-{self.starts}"),
            ],
        }

    def restart(self) -> None:
        self.stop(signal.SIGKILL)
        self.start()

    def stop(self, sig=signal.SIGTERM) -> None:
        for process in self.processes.values():
            stop_process(process, sig)

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.log_dir.glob("*.log"))
        )


# --- what the control-plane fault tests share ------------------------------------------


def task_statuses() -> dict[str, int]:
    """How many tasks are in each status."""
    return dict(Task.objects.values_list("status").annotate(n=Count("id")))


def submit_tasks(urls: list[str], key: str, names, **fields) -> list[int]:
    """One-card tasks of tenant `lab` created through the API, spread over the instances
    at `urls` in turn; their ids."""
    ids = []
    for name, url in zip(names, itertools.cycle(urls), strict=False):
        response = requests.post(
            f"{url}/api/v1/tasks",
            headers=bearer_http(key),
            timeout=60,
            json={"tenant": "lab", "name": name, "image": "busybox", "gpu_required": 1, **fields},
        )
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
    return ids


def assert_no_job_ran_over_its_period(runs_before: dict[str, int], elapsed: float) -> dict[str, int]:
    """No periodic job ran more often than its guard allows over `elapsed` seconds (one
    start per 80 % of its period, plus the first), whatever number of beats sent ticks.
    The scheduler's tick is left out: it also runs on demand when a task is created, by
    design. Returns the runs of each job since `runs_before` (JobRun.runs)."""
    runs = {row.key: row.runs - runs_before.get(row.key, 0) for row in JobRun.objects.all()}
    for job in declared_jobs().values():
        if job.name == "scheduler.tick" or job.every > elapsed:
            continue
        allowed = math.floor(elapsed / (job.every * EARLY_FRACTION)) + 1
        assert runs.get(job.name, 0) <= allowed, (job.name, runs.get(job.name), allowed, elapsed)
    return runs


def wait_for_statuses(expected: dict[str, int], timeout: float, plane: ControlPlane | None = None) -> None:
    """Until the tasks' statuses are `expected`; a time-out says what they were then, with
    the control plane's logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if task_statuses() == expected:
            return
        time.sleep(0.2)
    pytest.fail(f"tasks never {expected}: {task_statuses()}\n{plane.logs() if plane else ''}")
