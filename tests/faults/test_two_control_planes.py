"""Scale-out on the same PostgreSQL and Redis: two complete control-plane instances (two
web servers, two Celery workers, two beats), a simulated fleet of 500 nodes spread over
both and working their tasks on the real task channel, tasks submitted to both. Midway,
one instance's web, worker and beat are killed with SIGKILL; the fleet's load balancer
moves its nodes to the other, which carries on with no manual step.

What must hold: every task completes, each claimed once (no task bound twice, no node
running more tasks than it has cards), no outcome lost (reports to the dead instance are
retried on the other), no node ever judged offline, and no periodic job ran more often
than its period allows although two beats sent every tick (the guard, apps/core/guard.py).
Nothing is shortened here: the periods are the real ones.
"""

from __future__ import annotations

import itertools
import math
import signal
import time

import pytest
import redis
import requests
from django.conf import settings
from django.db import connection
from django.db.models import Count

from apps.alerts.models import Alert
from apps.core.guard import EARLY_FRACTION, declared_jobs
from apps.core.models import JobRun
from apps.nodes.models import Node
from apps.scheduler.services import set_plugin_options
from apps.tasks.models import Task
from apps.tenants.services import create_tenant, issue_platform_key
from tests.factories import OperatorFactory
from tests.faults.cluster import ControlPlane, Fleet
from tests.headers import bearer_http
from tests.live import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

NODES = 500
TASKS = 300
RUN_SECONDS = 3.0


def statuses() -> dict[str, int]:
    return dict(Task.objects.values_list("status").annotate(n=Count("id")))


def submit(urls: list[str], key: str, numbers) -> list[int]:
    ids = []
    for n, url in zip(numbers, itertools.cycle(urls), strict=False):
        response = requests.post(
            f"{url}/api/v1/tasks",
            headers=bearer_http(key),
            timeout=30,
            json={"tenant": "lab", "name": f"job-{n}", "image": "busybox", "gpu_required": 1},
        )
        assert response.status_code == 201, response.text
        ids.append(response.json()["id"])
    return ids


def test_two_instances_share_the_work_and_one_survives_the_other_killed(tmp_path):
    redis.Redis.from_url(settings.REDIS_URL).delete("celery")  # no ticks left by earlier tests
    create_tenant(name="Lab", slug="lab")
    set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
    key = issue_platform_key(user=OperatorFactory(username="ops"), name="ops").key
    before = dict(JobRun.objects.values_list("key", "runs"))
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    started = time.monotonic()
    one = ControlPlane(tmp_path / "one").start()
    two = ControlPlane(tmp_path / "two").start()
    fleet = Fleet([one.url, two.url], tmp_path, nodes=NODES, prefix="so", run_tasks=RUN_SECONDS)
    try:
        fleet.wait_registered(timeout=180)
        wait_until(
            lambda: Node.objects.filter(pk__startswith="so-", status="online").count() == NODES,
            120,
            "the fleet online",
        )
        first = submit([one.url, two.url], key, range(TASKS * 2 // 3))
        wait_until(
            lambda: statuses().get("completed", 0) >= TASKS // 3,
            240,
            f"a third of the tasks done ({statuses()})\n{one.logs()}",
        )
        one.stop(signal.SIGKILL)  # web, worker and beat, mid-run, no warning
        rest = submit([two.url], key, range(TASKS * 2 // 3, TASKS))
        wait_until(
            lambda: statuses() == {"completed": TASKS},
            300,
            f"every task completed on the instance left ({statuses()})\n{two.logs()}",
        )
        elapsed = time.monotonic() - started
        figures = fleet.finish(timeout=0.1)
    finally:
        fleet.kill()
        one.stop(signal.SIGKILL)
        two.stop()
        connection.close()

    print(f"\ntwo control planes: {NODES} nodes, {TASKS} tasks, one instance killed; fleet {figures}")
    ids = sorted(first + rest)
    assert sorted(Task.objects.values_list("pk", flat=True)) == ids
    # each task bound and claimed once: one claim won per task, none lost to a double bind
    assert figures["claimed"] == TASKS, figures
    assert figures["most_at_once"] == 1, figures  # a node with one card never ran two tasks
    assert figures["moved"] > 0, figures  # the dead instance's nodes did move
    # no outcome lost: every report answered (retried on the other instance if need be)
    assert Task.objects.filter(status="completed", exit_code=0).count() == TASKS
    assert not Alert.objects.filter(type="NODE_OFFLINE").exists()
    assert not Alert.objects.filter(type="TASK_REQUEUED").exists()
    # two beats sent every tick; no periodic job ran more often than its period allows
    # (the scheduler's tick also runs on demand when a task is created, by design)
    runs = {row.key: row.runs - before.get(row.key, 0) for row in JobRun.objects.all()}
    for job in declared_jobs().values():
        if job.name == "scheduler.tick" or job.every > elapsed:
            continue
        allowed = math.floor(elapsed / (job.every * EARLY_FRACTION)) + 1
        assert runs.get(job.name, 0) <= allowed, (job.name, runs.get(job.name), allowed, elapsed)
    assert runs.get("nodes.check_health", 0) >= elapsed / 5 / 2  # and the jobs did run
