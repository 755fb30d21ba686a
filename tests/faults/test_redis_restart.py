"""Redis killed and started again under a running control plane.

Redis holds nothing that cannot be lost (the broker's messages, caches, rate-limit
counts): a whole control plane (web, worker, beat) runs on a Redis of its own, started
here, with a simulated fleet working its tasks on the real task channel. Redis is killed
with SIGKILL (it keeps nothing on disk), tasks are submitted while it is away, and it is
started again, empty, on the same port. The API keeps taking tasks while it is down, the
worker and beat reconnect, the periodic ticks resume, and every task completes: none is
lost because the tick message asking for its placement was.
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from django.db import connection

from apps.core.clock import utcnow
from apps.core.models import JobRun
from apps.scheduler.services import set_plugin_options
from apps.tasks.models import Task
from apps.tenants.services import create_tenant, issue_platform_key
from tests.factories import OperatorFactory
from tests.faults.cluster import ControlPlane, Fleet, submit_tasks, wait_for_statuses
from tests.live import free_port, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

NODES = 20
RUN_SECONDS = 2.0


def start_redis(port: int, log) -> subprocess.Popen:
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def answers():
        try:
            return subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout
        except OSError:
            return ""

    wait_until(lambda: "PONG" in answers(), 30, f"redis-server on {port}")
    return server


def timed_submit(url: str, key: str, names) -> list[float]:
    """Seconds each create took."""
    took = []
    for name in names:
        began = time.monotonic()
        submit_tasks([url], key, [name])
        took.append(time.monotonic() - began)
    return took


@pytest.mark.skipif(
    not subprocess.run(["which", "redis-server"], capture_output=True).stdout,
    reason="redis-server is not installed on this machine (Debian package redis-server); CI machines have it",
)
def test_redis_killed_and_started_empty_loses_no_task(tmp_path):
    create_tenant(name="Lab", slug="lab")
    set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
    key = issue_platform_key(user=OperatorFactory(username="ops"), name="ops").key
    port = free_port()
    log = open(tmp_path / "redis.log", "w")  # noqa: SIM115 (both servers write to it)
    redis_server = start_redis(port, log)
    plane = ControlPlane(tmp_path, REDIS_URL=f"redis://127.0.0.1:{port}/0").start()
    fleet = Fleet(plane.url, tmp_path, nodes=NODES, prefix="rd", run_tasks=RUN_SECONDS)
    try:
        fleet.wait_registered()
        submit_tasks([plane.url], key, [f"before-{n}" for n in range(10)])
        wait_for_statuses({"completed": 10}, 120, plane)

        stop_process(redis_server, signal.SIGKILL)
        down_at = utcnow()
        took = timed_submit(plane.url, key, [f"during-{n}" for n in range(5)])  # the tick messages are lost
        redis_server = start_redis(port, log)  # empty: no message, no cache, no count survived
        back_at = utcnow()
        submit_tasks([plane.url], key, [f"after-{n}" for n in range(5)])
        wait_for_statuses({"completed": 20}, 180, plane)
        wait_until(
            lambda: JobRun.objects.filter(key="nodes.check_health", last_started_at__gt=back_at).exists(),
            60,
            "the periodic ticks to resume",
        )
        figures = fleet.finish(timeout=0.1)
    finally:
        fleet.kill()
        plane.stop()
        stop_process(redis_server)
        log.close()
        connection.close()

    print(f"\nredis killed at {down_at:%H:%M:%S}, back at {back_at:%H:%M:%S}; creates meanwhile took {took}; {figures}")
    assert figures["claimed"] == 20, figures
    assert Task.objects.filter(status="completed", exit_code=0).count() == 20
    # the API did not hang on the missing broker (each create answered well within its timeout)
    assert max(took) < 30, took
