"""The database taken away from a running control plane and given back.

A whole control plane (web, worker, beat) with a simulated fleet working its tasks on the
real task channel (bench/fleet.py --run-tasks). Mid-run every control-plane connection to
the database is terminated (`pg_terminate_backend`) and new ones are refused
(`ALTER DATABASE … ALLOW_CONNECTIONS false`: to the control plane the database is down,
while the test keeps its own connection to watch). While it is down `/health` is 503 and
heartbeats get 503; the fleet keeps its outcomes and retries them. When it is back
everything converges: every task completes once, nothing is half written, and no periodic
job ran more often than its period allows (a connection terminated while it held a job's
transaction-level advisory lock took the lock with it, so no process goes on believing it
holds it).

The outage lasts longer than the tasks run, so their reports meet it. The periods are the
real ones.
"""

from __future__ import annotations

import time

import psycopg
import pytest
import redis
import requests
from django.conf import settings
from django.db import connection

from apps.alerts.models import Alert
from apps.core.models import JobRun
from apps.nodes.models import Node
from apps.scheduler.models import GpuAllocation
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
from tests.nodes.payloads import heartbeat

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

NODES = 40
TASKS = 30
RUN_SECONDS = 3.0
OUTAGE_SECONDS = 15.0  # past the pool's 10 s wait for a connection, so requests are refused, not delayed


def status_of(url: str, method: str = "GET", **kwargs) -> int:
    try:
        return requests.request(method, url, timeout=10, **kwargs).status_code
    except requests.RequestException:
        return -1


def admin_connection() -> psycopg.Connection:
    """A connection to the server's maintenance database: a database cannot refuse
    connections while the session changing it is inside it."""
    params = connection.get_connection_params()
    params["dbname"] = "postgres"
    return psycopg.connect(**{k: v for k, v in params.items() if k != "cursor_factory"}, autocommit=True)


def take_database_away(name: str) -> int:
    with admin_connection() as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        # every control-plane connection; this test's own (watching) is left alone
        watching = connection.cursor().connection.info.backend_pid
        return admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = %s AND pid <> %s",
            [name, watching],
        ).fetchone()[0]


def give_database_back(name: str) -> None:
    with admin_connection() as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


def test_connections_terminated_and_refused_then_everything_converges(tmp_path):
    redis.Redis.from_url(settings.REDIS_URL).delete("celery")
    create_tenant(name="Lab", slug="lab")
    set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
    key = issue_platform_key(user=OperatorFactory(username="ops"), name="ops").key
    before = dict(JobRun.objects.values_list("key", "runs"))
    name = connection.settings_dict["NAME"]
    started = time.monotonic()
    plane = ControlPlane(tmp_path).start()
    fleet = Fleet(plane.url, tmp_path, nodes=NODES, prefix="pg", run_tasks=RUN_SECONDS)
    beat = f"{plane.url}/api/v1/nodes/pg-00000/heartbeat"
    try:
        fleet.wait_registered()
        submit_tasks([plane.url], key, [f"job-{n}" for n in range(TASKS)])
        wait_until(lambda: task_statuses().get("running", 0) >= TASKS // 2, 120, f"tasks running ({task_statuses()})")

        terminated = take_database_away(name)
        try:
            assert terminated > 0  # the web's pools, the worker's and beat's connections
            wait_until(lambda: status_of(f"{plane.url}/health") == 503, 30, "/health to say 503")
            agent = {"X-API-Key": settings.HETEROFLOW_AGENT_SECRET}
            assert status_of(beat, "POST", json=heartbeat(), headers=agent) == 503
            down_since = time.monotonic()
            while time.monotonic() - down_since < OUTAGE_SECONDS:  # the outage, watched
                assert status_of(f"{plane.url}/health") == 503
                time.sleep(1.0)
        finally:
            give_database_back(name)

        wait_until(lambda: status_of(f"{plane.url}/health") == 200, 60, f"/health back to 200\n{plane.logs()}")
        wait_for_statuses({"completed": TASKS}, 180, plane)
        # every node beats its way back: nodes silent through the outage may show suspect
        # until their next beat lands (the health check runs every 5 s, beats come every 5 s)
        wait_until(
            lambda: Node.objects.filter(pk__startswith="pg-", status="online").count() == NODES,
            60,
            "every node online again",
        )
        elapsed = time.monotonic() - started
        figures = fleet.finish(timeout=0.1)
    finally:
        give_database_back(name)
        fleet.kill()
        plane.stop()
        # this process's own pool lost its idle connections too, and may be waiting out
        # its reconnection back-off: a new pool for the checks below
        connection.close()
        connection.close_pool()

    print(f"\ndatabase away for {OUTAGE_SECONDS:.0f} s: {terminated} connections terminated; fleet {figures}")
    assert figures["claimed"] == TASKS, figures  # each task claimed once
    assert figures["reports_retried"] > 0, figures  # reports met the outage and were kept
    assert figures["failures"].get("503", 0) > 0, figures  # beats were refused, not lost silently
    # nothing half written: every end settled once, every card given back
    assert Task.objects.filter(status="completed", exit_code=0, finished_at__isnull=False).count() == TASKS
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*), count(DISTINCT task_id) FROM usage_records")
        assert cursor.fetchone() == (TASKS, TASKS)
    assert not GpuAllocation.objects.exists()
    assert Node.objects.filter(pk__startswith="pg-", status="online").count() == NODES
    assert not Alert.objects.filter(type__in=("NODE_OFFLINE", "TASK_REQUEUED", "TASK_FAILED")).exists()
    assert_no_job_ran_over_its_period(before, elapsed)
    # and the jobs came back after the outage (the health check runs every 5 s)
    assert JobRun.objects.get(key="nodes.check_health").last_outcome == "ran"
