"""Slices end to end against the whole control plane (web, Celery worker and beat).

1. A software slice with a real agent process (process runtime): a memory-only task
   binds with a slice of the node's card (no MIG, no MPS daemon: software, born
   confirmed), the agent starts it inside the slice (its process records its
   environment: the limit variables are there), it completes, and the slice is
   released.
2. A MIG slice with the agent's own parts assembled in this process (this machine is a
   container, where a real agent process reports software slices only): its detection,
   heartbeat, executor and slice channel over a stateful stand-in nvidia-smi in MIG
   mode. The create request is claimed and executed (a MIG instance is made), the slice
   confirmed with its MIG UUID, the task runs seeing only that MIG device, completes,
   and the destroy request removes the instance: the slice is released and the card
   is empty again."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest
import redis
from django.conf import settings

from agent.tests.slicing_host import Cards
from apps.nodes.models import Node
from apps.scheduler.services import set_plugin_options
from apps.slices.models import Slice, SliceRequest
from apps.tasks.models import Task
from apps.tenants.services import create_tenant
from heteroflow_agent.channels.slices import SliceChannel, default_vendors
from heteroflow_agent.client import ServerClient
from heteroflow_agent.config import AgentConfig
from heteroflow_agent.detect import Detector
from heteroflow_agent.executor import Executor
from heteroflow_agent.heartbeat import Heartbeat
from heteroflow_agent.main import run, run_executor
from heteroflow_agent.runtime.process import ProcessRuntime
from tests.faults.cluster import ControlPlane
from tests.live import start_agent, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
QUICK = {"HETEROFLOW_RECONCILE_SECONDS": "5", "HETEROFLOW_REPORT_ATTEMPTS": "2"}

# nvidia-smi as the agent's detection runs it: one idle 80 GB card, not in MIG mode
CARD = "0, GPU-slice-e2e-0, NVIDIA A100-SXM4-80GB, 81920, 0, 0, 30, 60.0, 8.0"
STAND_IN = """#!/bin/sh
case "$*" in
  *--query-gpu*) printf '{card}\\n' ;;
  *topo*) cat "{fixtures}/topo_2x_pcie.txt" ;;
  *) exit 0 ;;
esac
"""
FIXTURES = Path(__file__).resolve().parents[2] / "agent" / "tests" / "fixtures" / "nvidia"
SHOWN = (
    "HETEROFLOW_SLICE_ID",
    "HETEROFLOW_SLICE_TIER",
    "HETEROFLOW_SLICE_QOS",
    "HETEROFLOW_GPU_MEMORY_LIMIT_MB",
    "HETEROFLOW_GPU_MEMORY_FRACTION",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
)
# the task: print the slice's variables (they land in the reported log tail) and keep
# them in a file for the test
TASK = f"""
import json, os, sys
seen = {{name: os.environ.get(name) for name in {SHOWN!r}}}
for name, value in seen.items():
    print(f"{{name}}={{value}}")
with open(sys.argv[1], "w") as out:
    json.dump(seen, out)
"""


def test_a_memory_only_task_runs_inside_its_software_slice_and_releases_it(tmp_path):
    redis.Redis.from_url(settings.REDIS_URL).delete("celery")  # no ticks queued by earlier tests
    plane = ControlPlane(tmp_path).start()
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(STAND_IN.format(card=CARD, fixtures=FIXTURES))
    (tools / "nvidia-smi").chmod(0o755)
    script = tmp_path / "show_env.py"
    script.write_text(TASK)
    agent = start_agent(plane.url, tmp_path / "agent", PATH=f"{tools}{os.pathsep}{os.environ.get('PATH', '')}", **QUICK)

    def logs() -> str:
        return plane.logs() + f"\n--- agent\n{agent.log_path.read_text()[-4000:]}"

    try:
        wait_until(
            lambda: Node.objects.filter(status="online", gpu_type="nvidia", gpu_count=1).exists(),
            90,
            f"the node online with its card\n{logs()}",
        )
        tenant = create_tenant(name="Lab", slug="lab")
        set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
        seen_path = tmp_path / "seen.json"
        task = Task.objects.create(
            tenant=tenant,
            name="share",
            gpu_required=0,
            gpu_memory_mb=20480,
            gpu_type="nvidia",
            command=[sys.executable, str(script), str(seen_path)],
            # the task's own values of the agent's variables are replaced
            env={"HETEROFLOW_GPU_MEMORY_LIMIT_MB": "999999"},
            timeout_seconds=120,
        )
        wait_until(
            lambda: Task.objects.get(pk=task.pk).status == "completed",
            90,
            f"the task completed ({Task.objects.get(pk=task.pk).status})\n{logs()}",
        )
        slice_ = Slice.objects.get(task=task)
        assert (slice_.tier, slice_.memory_mb, slice_.gpu_index) == ("software", 20480, 0)
        seen = json.loads(seen_path.read_text())
        assert seen == {
            "HETEROFLOW_SLICE_ID": str(slice_.pk),
            "HETEROFLOW_SLICE_TIER": "software",
            "HETEROFLOW_SLICE_QOS": "bronze",
            "HETEROFLOW_GPU_MEMORY_LIMIT_MB": "20480",
            "HETEROFLOW_GPU_MEMORY_FRACTION": "0.250",  # 20480 of 81920 MB
            "CUDA_VISIBLE_DEVICES": "0",
            "NVIDIA_VISIBLE_DEVICES": "0",
        }
        task.refresh_from_db()
        assert "HETEROFLOW_GPU_MEMORY_LIMIT_MB=20480" in task.log_tail
        wait_until(
            lambda: Slice.objects.get(pk=slice_.pk).state == "released",
            30,
            f"the slice released ({Slice.objects.get(pk=slice_.pk).state})\n{logs()}",
        )
    finally:
        stop_process(agent)
        plane.stop()


def test_a_mig_slice_is_made_used_and_destroyed_through_the_channel(tmp_path):
    redis.Redis.from_url(settings.REDIS_URL).delete("celery")
    plane = ControlPlane(tmp_path).start()
    cards = Cards(tmp_path)
    cards.nvidia(count=1)  # an A100 40GB in MIG mode, no instances
    script = tmp_path / "show_env.py"
    script.write_text(TASK)
    data_dir = tmp_path / "agent"
    data_dir.mkdir()
    cfg = AgentConfig(
        server_url=plane.url,
        api_key=settings.HETEROFLOW_AGENT_SECRET,
        node_id="mig-node",
        data_dir=data_dir,
        allow_process_runtime=True,
        model_scan_dirs=(str(data_dir / "models"),),
    )
    client = ServerClient(cfg.server_url, cfg.api_key)
    detector = Detector(str(cards.root), timeout=10.0, nvml=False, is_container=False)
    executor = Executor(
        cfg.node_id, client, ProcessRuntime(data_dir / "process-tasks"), vendor="nvidia", stop_poll_seconds=1.0
    )
    heartbeat = Heartbeat(
        cfg,
        client,
        detect_gpus=detector.detect,
        tasks=executor.report,
        on_scheduled=lambda ids: executor.wake.set(),
        on_delivered=executor.sweep.set,
    )
    slices = SliceChannel(
        cfg.node_id, ServerClient(cfg.server_url, cfg.api_key), vendors=default_vendors(str(cards.root))
    )
    stop = threading.Event()
    threads = [
        threading.Thread(target=run, args=(heartbeat, stop), daemon=True),
        threading.Thread(target=run_executor, args=(executor, stop), kwargs={"reconcile_seconds": 5}, daemon=True),
    ]
    for thread in threads:
        thread.start()
    slices.start()

    def state() -> str:
        slices_now = list(Slice.objects.values("state", "device_id"))
        requests_now = list(SliceRequest.objects.values("action", "status", "error"))
        return f"{slices_now} {requests_now}\n{plane.logs()[-4000:]}"

    try:
        wait_until(
            lambda: Node.objects.filter(pk="mig-node", status="online", gpu_count=1).exists(),
            60,
            f"the MIG node online\n{plane.logs()}",
        )
        node = Node.objects.get(pk="mig-node")
        assert node.gpu_capabilities["0"]["mig_capable"] is True and node.gpu_capabilities["0"]["mig_instances"] == []
        tenant = create_tenant(name="Lab", slug="lab")
        set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
        seen_path = tmp_path / "seen.json"
        task = Task.objects.create(
            tenant=tenant,
            name="mig-share",
            gpu_required=0,
            gpu_memory_mb=4096,
            gpu_type="nvidia",
            command=[sys.executable, str(script), str(seen_path)],
            timeout_seconds=120,
        )
        wait_until(
            lambda: Task.objects.get(pk=task.pk).status == "completed",
            90,
            f"the task completed ({Task.objects.get(pk=task.pk).status}) {state()}",
        )
        slice_ = Slice.objects.get(task=task)
        assert (slice_.tier, slice_.profile) == ("mig", "1g.5gb")
        assert slice_.device_id.startswith("MIG-") and slice_.handles == {"gi": 1, "ci": 0}
        seen = json.loads(seen_path.read_text())
        assert seen["CUDA_VISIBLE_DEVICES"] == seen["NVIDIA_VISIBLE_DEVICES"] == slice_.device_id
        assert (seen["HETEROFLOW_SLICE_TIER"], seen["HETEROFLOW_SLICE_QOS"]) == ("mig", "gold")
        assert seen["HETEROFLOW_GPU_MEMORY_LIMIT_MB"] is None  # the MIG device is all its own
        wait_until(
            lambda: Slice.objects.get(pk=slice_.pk).state == "released",
            60,
            f"the slice released {state()}",
        )
        assert cards.instances() == []  # destroyed on the card
        actions = list(SliceRequest.objects.filter(slice=slice_).order_by("pk").values_list("action", "status"))
        assert actions == [("create", "completed"), ("destroy", "completed")]
        assert [c for c in cards.calls("mig") if "-cgi" in c] == [["mig", "-cgi", "19", "-C", "-i", "0"]]
    finally:
        stop.set()
        slices.close()
        for thread in threads:
            thread.join(timeout=30)
        executor.close()
        client.close()
        plane.stop()
