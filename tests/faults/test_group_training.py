"""A training group with real agents: three agents as three nodes on this machine (the
process runtime; a stand-in nvidia-smi gives each two cards), the whole control plane
(web, Celery worker and beat). A 2-node × 2-worker group's workers rendezvous over the
MASTER_ADDR:MASTER_PORT they were given and sum their RANKs over TCP (a small
all-reduce: rank 0 listens, the others connect), then complete. Then the same group
with one of its agents killed mid-run (no farewell, its processes gone, as a machine
losing power): the group is requeued once, whole, placed again on the two live nodes,
rendezvouses again, and completes."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.db.models import Count

from apps.nodes.models import Node
from apps.scheduler.services import set_plugin_options
from apps.tasks.models import Task, TaskEvent, TaskGroup
from apps.tasks.ranks import RANK_VARIABLES
from apps.tenants.services import create_tenant
from heteroflow_agent.runtime.process import ProcessRuntime
from tests.faults.cluster import ControlPlane
from tests.live import start_agent, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
OFFLINE_SECONDS, SWEEP_SECONDS = 15, 5
QUICK = {"HETEROFLOW_RECONCILE_SECONDS": "5", "HETEROFLOW_REPORT_ATTEMPTS": "2"}

# nvidia-smi as the agent's detection runs it: two idle cards, PCIe between them
CARD = "{index}, GPU-{node}-{index}, NVIDIA A100-SXM4-80GB, 81920, 0, 0, 30, 60.0, 8.0"
STAND_IN = """#!/bin/sh
case "$*" in
  *--query-gpu*) printf '{cards}\\n' ;;
  *topo*) cat "{fixtures}/topo_2x_pcie.txt" ;;
  *) exit 0 ;;
esac
"""
FIXTURES = Path(__file__).resolve().parents[2] / "agent" / "tests" / "fixtures" / "nvidia"

# Each worker: the all-reduce over the injected rendezvous, a record of what it saw,
# then it waits for the test's word (so that it can be caught mid-run) and exits 0.
WORKER = """
import json, os, socket, sys, time

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
deadline = time.monotonic() + 60
if rank == 0:
    server = socket.create_server(("0.0.0.0", port))
    server.settimeout(60)
    peers, total = [], rank
    while len(peers) < world - 1:
        conn, _ = server.accept()
        stream = conn.makefile("rw")
        total += int(stream.readline())
        peers.append((conn, stream))
    for conn, stream in peers:
        stream.write(f"{total}\\n")
        stream.flush()
        conn.close()
    server.close()
else:
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.2)
    stream = conn.makefile("rw")
    stream.write(f"{rank}\\n")
    stream.flush()
    total = int(stream.readline())
    conn.close()
names = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "HETEROFLOW_DIST_BACKEND")
record = {name: os.environ[name] for name in names} | {"sum": total, "task": os.environ["TASK_NAME"]}
path = os.path.join(os.environ["OUT_DIR"], f"rank{rank}-{os.getpid()}.json")
with open(path + ".tmp", "w") as out:
    json.dump(record, out)
os.rename(path + ".tmp", path)
if total != world * (world - 1) // 2:
    sys.exit(4)
# held running until the test releases it, never past the bound (a test that died
# leaves no worker behind)
released_by = time.monotonic() + 120
while not os.path.exists(os.environ["RELEASE"]):
    if time.monotonic() > released_by:
        sys.exit(5)
    time.sleep(0.2)
"""


def submit_group(tenant, name: str, script: Path, out_dir: Path, release: Path) -> TaskGroup:
    """A group as a submission leaves it: 4 workers × 1 card, DDP, every member pending."""
    out_dir.mkdir()
    group = TaskGroup.objects.create(
        tenant=tenant, name=name, world_size=4, gpus_per_worker=1, gpu_type="nvidia", command=["python"]
    )
    Task.objects.bulk_create(
        Task(
            tenant=tenant,
            name=f"{name}-{rank}",
            kind="training",
            group=group,
            rank=rank,
            gpu_required=1,
            gpu_type="nvidia",
            command=[sys.executable, str(script)],
            env={"OUT_DIR": str(out_dir), "RELEASE": str(release), "TASK_NAME": f"{name}-{rank}"},
            timeout_seconds=600,
        )
        for rank in range(4)
    )
    return group


def records(out_dir: Path) -> dict[str, dict]:
    """What the workers recorded, by file (one per worker process)."""
    return {path.name: json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))}


def rendezvous_checked(found: list[dict], group: TaskGroup) -> None:
    """One attempt's four records: every rank once, the sum of ranks seen by all, two
    workers on each of two nodes, the master's port as the group's network says."""
    assert sorted(int(r["RANK"]) for r in found) == [0, 1, 2, 3], found
    assert all(r["sum"] == 6 and r["WORLD_SIZE"] == "4" and r["LOCAL_WORLD_SIZE"] == "2" for r in found), found
    assert sorted((r["NODE_RANK"], r["LOCAL_RANK"]) for r in found) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    group.refresh_from_db()
    assert {r["MASTER_PORT"] for r in found} == {str(group.network["master_port"])}
    assert {r["HETEROFLOW_DIST_BACKEND"] for r in found} == {group.network["backend"]}
    assert set(RANK_VARIABLES) <= set(found[0])


def group_statuses(group) -> list[str]:
    return list(Task.objects.filter(group=group).order_by("rank").values_list("status", flat=True))


def kill_machine(agent, data_dir: Path) -> None:
    """A machine losing power: the agent dies without a farewell and its tasks with it."""
    stop_process(agent, signal.SIGKILL)
    runtime = ProcessRuntime(data_dir / "process-tasks")
    for task_id in runtime.tasks():
        runtime.stop(task_id, 1)
        runtime.remove(task_id)


def test_a_group_rendezvouses_completes_and_survives_a_lost_node(tmp_path):
    redis.Redis.from_url(settings.REDIS_URL).delete("celery")  # no ticks queued by earlier tests
    plane = ControlPlane(
        tmp_path,
        HETEROFLOW_NODE_OFFLINE_SECONDS=str(OFFLINE_SECONDS),
        HETEROFLOW_ALERT_SWEEP_SECONDS=str(SWEEP_SECONDS),
    ).start()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    dirs, agents = [tmp_path / f"agent-{n}" for n in range(3)], []
    for n, data_dir in enumerate(dirs):
        tools = tmp_path / f"tools-{n}"
        tools.mkdir()
        cards = "\\n".join(CARD.format(index=i, node=n) for i in range(2))
        (tools / "nvidia-smi").write_text(STAND_IN.format(cards=cards, fixtures=FIXTURES))
        (tools / "nvidia-smi").chmod(0o755)
        path = f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"
        agents.append(start_agent(plane.url, data_dir, PATH=path, **QUICK))

    def logs() -> str:
        return plane.logs() + "".join(f"\n--- {a.log_path.name}\n{a.log_path.read_text()[-3000:]}" for a in agents)

    try:
        wait_until(
            lambda: Node.objects.filter(status="online", gpu_type="nvidia", gpu_count=2).count() == 3,
            90,
            f"three nodes of two cards online\n{logs()}",
        )
        tenant = create_tenant(name="Lab", slug="lab")
        set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
        began = time.monotonic()

        # 1. rendezvous, all-reduce, complete
        release = tmp_path / "release-1"
        release.touch()
        first = submit_group(tenant, "ddp-1", script, tmp_path / "out-1", release)
        wait_until(
            lambda: group_statuses(first) == ["completed"] * 4,
            90,
            f"the group completed ({group_statuses(first)})\n{logs()}",
        )
        first.refresh_from_db()
        assert (first.status, first.attempts, first.ended_attempt) == ("completed", 1, 0)
        rendezvous_checked(list(records(tmp_path / "out-1").values()), first)
        assert len({t.node_id for t in Task.objects.filter(group=first)}) == 2
        print(f"\na 2 × 2 group placed, rendezvoused and completed in {time.monotonic() - began:.1f} s")

        # 2. the same group, one of its nodes lost mid-run
        began = time.monotonic()
        release = tmp_path / "release-2"
        second = submit_group(tenant, "ddp-2", script, tmp_path / "out-2", release)
        wait_until(
            lambda: len(records(tmp_path / "out-2")) == 4 and group_statuses(second) == ["running"] * 4,
            90,
            f"the second group running past its rendezvous ({group_statuses(second)})\n{logs()}",
        )
        attempt_one = records(tmp_path / "out-2")
        rendezvous_checked(list(attempt_one.values()), second)
        placed = dict(Task.objects.filter(group=second).values_list("rank", "node_id"))
        victim = placed[0]  # the master's node
        agent_of = {(d / "node-id").read_text().strip(): (agent, d) for agent, d in zip(agents, dirs, strict=True)}
        kill_machine(*agent_of[victim])
        killed_at = time.monotonic()

        def placed_again():
            second.refresh_from_db()
            return second.attempts == 2 and group_statuses(second) == ["running"] * 4

        wait_until(placed_again, 120, f"the group placed again and running ({group_statuses(second)})\n{logs()}")
        requeued_in = time.monotonic() - killed_at
        again = dict(Task.objects.filter(group=second).values_list("rank", "node_id"))
        assert victim not in again.values() and len(set(again.values())) == 2
        release.touch()
        wait_until(
            lambda: group_statuses(second) == ["completed"] * 4,
            60,
            f"the requeued group completed ({group_statuses(second)})\n{logs()}",
        )
        second.refresh_from_db()
        assert (second.status, second.attempts, second.ended_attempt) == ("completed", 2, 1)
        attempt_two = {name: r for name, r in records(tmp_path / "out-2").items() if name not in attempt_one}
        assert len(attempt_two) == 4  # four workers again, new processes
        rendezvous_checked(list(attempt_two.values()), second)
        # requeued once, whole: one group_requeued event per member, the lost ones lost once
        per_task = dict(
            TaskEvent.objects.filter(task__group=second, kind="group_requeued")
            .values_list("task")
            .annotate(n=Count("id"))
        )
        assert sorted(per_task.values()) == [1, 1, 1, 1]
        lost = TaskEvent.objects.filter(task__group=second, kind="node_lost_pending")
        assert sorted(lost.values_list("task__rank", flat=True)) == sorted(r for r, n in placed.items() if n == victim)
        assert not Task.objects.filter(group=second).exclude(status="completed").exists()
        print(
            f"one of its nodes killed mid-run: placed again {requeued_in:.1f} s after the kill "
            f"(threshold {OFFLINE_SECONDS} s, sweep every {SWEEP_SECONDS} s), completed "
            f"{time.monotonic() - began:.1f} s after it was submitted"
        )
    finally:
        for agent in agents:
            stop_process(agent)
        for data_dir in dirs:
            runtime = ProcessRuntime(data_dir / "process-tasks")
            for task_id in runtime.tasks():
                runtime.stop(task_id, 1)
                runtime.remove(task_id)
        plane.stop()
