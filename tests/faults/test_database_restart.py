"""The PostgreSQL server itself stopped and started under a running control plane.

The machine's PostgreSQL serves the rest of the suite, so this test gives a whole control
plane (web, worker, beat) a server of its own: the embedded one (pgserver, as `make up`
runs it) in a scratch folder, migrated and bootstrapped the way a deployment is. A
simulated fleet works its tasks on the real task channel. Midway the server is stopped
(`pg_ctl stop -m fast`: every connection cut, nothing listening), kept down, and started
again. While it is down `/health` is 503 and heartbeats are 503; after, every task
completes once and the ticks resume, with no process restarted by hand.
(test_database_loss.py terminates the connections of the shared server instead.)
"""

from __future__ import annotations

import time

import psycopg
import pytest
import redis
import requests
from django.conf import settings

from tests.faults.cluster import ControlPlane, Fleet
from tests.headers import bearer_http
from tests.live import wait_until
from tests.nodes.payloads import heartbeat

pytestmark = [pytest.mark.e2e]

NODES = 10
TASKS = 12
RUN_SECONDS = 4.0
DOWN_SECONDS = 6.0


def status_of(url: str, method: str = "GET", **kwargs) -> int:
    try:
        return requests.request(method, url, timeout=10, **kwargs).status_code
    except requests.RequestException:
        return -1


def pg_ctl(server, *args: str) -> None:
    from pgserver._commands import pg_ctl as run

    run(["-w", *args], pgdata=server.pgdata, user=server.system_user, timeout=60)


def counts(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        return dict(conn.execute("SELECT status, count(*) FROM tasks GROUP BY status").fetchall())


def test_postgresql_stopped_and_started_again(tmp_path, own_postgres):
    server, socket_dir, url, key = own_postgres
    redis.Redis.from_url(settings.REDIS_URL).delete("celery")
    plane = ControlPlane(tmp_path, DATABASE_URL=url).start()
    fleet = Fleet(plane.url, tmp_path, nodes=NODES, prefix="pgr", run_tasks=RUN_SECONDS)
    operator = bearer_http(key)
    try:
        fleet.wait_registered()
        assert requests.post(f"{plane.url}/api/v1/tenants", json={"name": "Lab", "slug": "lab"}, headers=operator).ok
        loose = {"extra": {"cpu_percent_max": 100, "memory_percent_max": 100}}
        assert requests.put(f"{plane.url}/api/v1/plugins/resource-filter", json=loose, headers=operator).ok
        for n in range(TASKS):
            body = {"tenant": "lab", "name": f"job-{n}", "image": "busybox", "gpu_required": 1}
            response = requests.post(f"{plane.url}/api/v1/tasks", json=body, headers=operator, timeout=30)
            assert response.status_code == 201, response.text
        wait_until(lambda: counts(url).get("running", 0) >= 1, 120, "tasks running")

        pg_ctl(server, "stop", "-m", "fast")
        stopped = time.monotonic()
        wait_until(lambda: status_of(f"{plane.url}/health") == 503, 30, "/health to say 503")
        beat = f"{plane.url}/api/v1/nodes/pgr-00000/heartbeat"
        agent = {"X-API-Key": settings.HETEROFLOW_AGENT_SECRET}
        assert status_of(beat, "POST", json=heartbeat(), headers=agent) == 503
        while time.monotonic() - stopped < DOWN_SECONDS:
            assert status_of(f"{plane.url}/health") == 503
            time.sleep(1.0)
        pg_ctl(server, "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(server.log), "start")

        wait_until(lambda: status_of(f"{plane.url}/health") == 200, 60, f"/health back\n{plane.logs()}")
        wait_until(lambda: counts(url) == {"completed": TASKS}, 180, f"every task completed\n{plane.logs()}")
        figures = fleet.finish(timeout=0.1)
    finally:
        fleet.kill()
        plane.stop()
    print(f"\nPostgreSQL stopped for {DOWN_SECONDS:.0f} s and started again; fleet {figures}")
    assert figures["claimed"] == TASKS, figures
    assert figures["failures"].get("503", 0) > 0, figures
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT task_id) FROM usage_records").fetchone() == (TASKS, TASKS)
        assert conn.execute("SELECT count(*) FROM gpu_allocations").fetchone() == (0,)
        offline = conn.execute("SELECT count(*) FROM alerts WHERE type = 'NODE_OFFLINE'").fetchone()
        assert offline == (0,)
        ran = conn.execute("SELECT last_outcome FROM job_runs WHERE key = 'nodes.check_health'").fetchone()
        assert ran == ("ran",)
