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

import signal
import time

import pytest
import redis
from django.conf import settings
from django.db import connection

from apps.alerts.models import Alert
from apps.core.models import JobRun
from apps.nodes.models import Node
from apps.scheduler.services import set_plugin_options
from apps.tasks.models import Task
from apps.tenants.services import create_tenant, issue_platform_key
from tests.factories import OperatorFactory
from tests.faults.cluster import (
    ControlPlane,
    Fleet,
    assert_no_job_ran_over_its_period,
    submit_tasks,
    task_statuses,
    wait_for_statuses,
)
from tests.live import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

NODES = 500
TASKS = 300
RUN_SECONDS = 3.0


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
        first = submit_tasks([one.url, two.url], key, [f"job-{n}" for n in range(TASKS * 2 // 3)])
        wait_until(
            lambda: task_statuses().get("completed", 0) >= TASKS // 3,
            240,
            f"a third of the tasks done ({task_statuses()})\n{one.logs()}",
        )
        one.stop(signal.SIGKILL)  # web, worker and beat, mid-run, no warning
        rest = submit_tasks([two.url], key, [f"job-{n}" for n in range(TASKS * 2 // 3, TASKS)])
        wait_for_statuses({"completed": TASKS}, 300, two)
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
    runs = assert_no_job_ran_over_its_period(before, elapsed)
    assert runs.get("nodes.check_health", 0) >= elapsed / 5 / 2  # and the jobs did run
