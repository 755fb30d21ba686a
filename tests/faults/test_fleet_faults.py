"""Fleet-scale faults with real processes: simulated nodes (bench/fleet.py) send real
heartbeats over HTTP to the control plane under uvicorn, and the sweeps run here, in the
test process, as a second control-plane instance would.

- Mass failure: a rack of 1,000 nodes with running tasks goes silent at once; every task
  is requeued exactly once and every alert raised within two sweeps (two instances
  sweeping at the same moment), and the nodes are online on their next beat.
- Flapping: 500 nodes beating with ±20 % jitter raise no NODE_OFFLINE.

The offline threshold is shortened from 45 s to keep the tests short; the rule is the
same (docs/failures.md). bench/sweep.py measures the sweep's cost against fleet size.
"""

from __future__ import annotations

import subprocess
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.db.models import Count, Max

from apps.alerts.failures import sweep
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.nodes.models import Node
from apps.nodes.services import refresh_node_statuses
from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle, set_plugin_options
from apps.tasks.models import Task, TaskEvent
from apps.tasks.services import move_tasks
from apps.tenants.services import create_tenant
from tests.faults.cluster import Fleet
from tests.live import start_control_plane, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

RACK = 1000


def online(prefix: str) -> int:
    return Node.objects.filter(pk__startswith=f"{prefix}-", status="online").count()


def sweep_from_two_instances():
    """Two sweeps at the same moment, each on its own database connection."""
    results, errors = [None, None], []

    def instance(slot):
        try:
            results[slot] = sweep()
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=instance, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return results


def test_a_rack_of_1000_nodes_going_silent_requeues_each_task_exactly_once(tmp_path, settings):
    settings.HETEROFLOW_NODE_OFFLINE_SECONDS = 10
    server, url = start_control_plane()
    rack = Fleet(url, tmp_path, nodes=RACK, prefix="rack", interval=5)
    row = None
    try:
        rack.wait_registered()
        wait_until(lambda: online("rack") == RACK, 60, "the rack online")
        tenant = create_tenant(name="Lab", slug="lab")
        set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
        # one running task per rack node
        Task.objects.bulk_create(Task(tenant=tenant, name=f"job-{n}", image="x", gpu_required=1) for n in range(RACK))
        wait_until(lambda: run_cycle() and not Task.objects.filter(status="pending").exists(), 120, "every task placed")
        scheduled = list(Task.objects.filter(status="scheduled").values_list("pk", flat=True))
        assert len(move_tasks(scheduled, ["scheduled"], "running")) == RACK  # the agents' claims
        assert Task.objects.filter(status="running", node__id__startswith="rack-").count() == RACK
        row = Fleet(url, tmp_path, nodes=5, prefix="row", interval=2)  # the rest of the data centre, still up
        row.wait_registered()

        rack.kill()
        last = Node.objects.filter(pk__startswith="rack-").aggregate(last=Max("last_heartbeat_at"))["last"]
        # until every rack node has been silent for longer than the threshold, a sweep may
        # catch part of the rack: that is fine, as long as each task moves once
        wait_until(
            lambda: utcnow() > last + timedelta(seconds=settings.HETEROFLOW_NODE_OFFLINE_SECONDS + 0.5),
            30,
            "the rack to be silent past the threshold",
        )
        started = time.perf_counter()
        first = sweep_from_two_instances()
        second = sweep_from_two_instances()
        elapsed = time.perf_counter() - started
        print(f"\nmass failure: {RACK} nodes, two rounds of two concurrent sweeps in {elapsed:.2f} s")

        requeued = [pk for result in first + second for pk in result.requeued]
        assert sorted(requeued) == sorted(scheduled)  # each task moved once, by one of the sweeps
        assert all(not result.requeued for result in second)  # the second round found nothing left
        assert Task.objects.filter(status="pending", node__isnull=True).count() == RACK
        assert not GpuAllocation.objects.filter(node__id__startswith="rack-").exists()
        events = TaskEvent.objects.filter(kind="node_lost_pending").values("task").annotate(n=Count("id"))
        assert len(events) == RACK and {row["n"] for row in events} == {1}
        alerts = Alert.objects.filter(state="ACTIVE")
        assert alerts.filter(type="NODE_OFFLINE", node_id__startswith="rack-").count() == RACK
        assert alerts.filter(type="TASK_REQUEUED").count() == RACK
        assert not alerts.filter(type="NODE_OFFLINE", node_id__startswith="row-").exists()

        # the health checker has marked the rack offline by now (a minute of silence)
        refresh_node_statuses(now=utcnow() + timedelta(seconds=61))
        assert online("rack") == 0
        # the rack comes back: online on its next beat, alerts recovered by the next sweep
        back = Fleet(url, tmp_path, nodes=RACK, prefix="rack", interval=5)
        try:
            back.wait_registered()
            assert online("rack") == RACK
            assert sorted(sweep().recovered) == sorted(
                Node.objects.filter(pk__startswith="rack-").values_list("pk", flat=True)
            )
            assert not Alert.objects.filter(type="NODE_OFFLINE", state="ACTIVE").exists()
        finally:
            back.kill()
    finally:
        rack.kill()
        if row:
            row.kill()
        stop_process(server)
        connection.close()


def test_500_nodes_beating_with_jitter_raise_no_node_offline(tmp_path, settings):
    """Beats every 2.5 s ± 20 % (5 s scaled down, to see more beats in less time) for 30 s,
    with sweeps every 2 s against a threshold of 15 s: six intervals, where production
    has nine (45 s for 5 s beats)."""
    settings.HETEROFLOW_NODE_OFFLINE_SECONDS = 15
    server, url = start_control_plane()
    fleet = Fleet(url, tmp_path, nodes=500, prefix="flap", interval=2.5, jitter=0.2, duration=30)
    try:
        fleet.wait_registered()
        sweeps = 0
        while True:  # a sweep every 2 s for as long as the fleet beats
            result = sweep()
            assert result.offline == [], f"flagged offline: {result.offline[:10]}"
            sweeps += 1
            try:
                fleet.process.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                pass
        figures = fleet.finish()
        print(f"\nflapping: {figures}, {sweeps} sweeps")
        assert figures["beats"] >= 500 * 30 / 2.5 * 0.8 and not figures["failures"], figures
        assert figures["max_gap_seconds"] < settings.HETEROFLOW_NODE_OFFLINE_SECONDS
        assert not Alert.objects.filter(type="NODE_OFFLINE").exists()
        assert not Node.objects.filter(pk__startswith="flap-").exclude(status="online").exists()
    finally:
        fleet.kill()
        stop_process(server)
