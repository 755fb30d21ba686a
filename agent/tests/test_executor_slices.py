"""The executor and slices: the variables (and mounts) that put a task inside its
confirmed slice, vLLM's share of a card, and "no limit, no start" for a memory-only
task whose slice is not confirmed."""

from __future__ import annotations

import pytest

from heteroflow_agent.client import ServerClient
from heteroflow_agent.engines.router import LLAMACPP, VLLM, Route
from heteroflow_agent.executor import Executor
from heteroflow_agent.runtime import RuntimeError_, Volume
from heteroflow_agent.task_spec import memory_fraction, slice_env

MIG_UUID = "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f"


def a_slice(tier: str, **extra) -> dict:
    base = {
        "id": 41,
        "tier": tier,
        "qos": {"mig": "gold", "mps": "silver"}.get(tier, "bronze"),
        "state": "confirmed",
        "gpu_index": 2,
        "gpu_uuid": "GPU-aaa",
        "memory_mb": 10240,
        "memory_total_mb": 40960,
        "compute_percent": 25,
        "profile": "",
        "device_id": "GPU-aaa",
    }
    base.update(extra)
    return base


def memory_task(slice_=None, **extra) -> dict:
    task = {
        "id": 9,
        "name": "share",
        "image": "busybox",
        "command": ["env"],
        "gpu_required": 0,
        "gpu_memory_mb": 10240,
        "gpu_indices": [2],
        "env": {"HETEROFLOW_GPU_MEMORY_LIMIT_MB": "999999", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "MINE": "x"},
        "slice": slice_,
    }
    task.update(extra)
    return task


class Kind:
    """A runtime that is only its kind (spec_for asks no more of it)."""

    def __init__(self, kind: str):
        self.kind = kind


def executor(kind: str = "process", vendor: str = "nvidia", client=None) -> Executor:
    made = Executor("n1", client or ServerClient("http://x", "k"), runtime=Kind(kind), vendor=vendor, workers=2)
    made.mps_pipe, made.mps_log = "/run/nvidia-mps", "/var/log/nvidia-mps"
    return made


def test_the_fraction_is_rounded_down_to_three_decimals():
    assert memory_fraction({"memory_mb": 10240, "memory_total_mb": 40960}) == "0.250"
    assert memory_fraction({"memory_mb": 1000, "memory_total_mb": 3000}) == "0.333"
    assert memory_fraction({"memory_mb": 2999, "memory_total_mb": 3000}) == "0.999"
    assert memory_fraction({"memory_mb": 1000, "memory_total_mb": None}) is None


def test_a_mig_slice_shows_the_task_its_mig_device_only():
    env = slice_env("nvidia", a_slice("mig", device_id=MIG_UUID), mps_pipe="/p", mps_log="/l")
    assert env == {
        "NVIDIA_VISIBLE_DEVICES": MIG_UUID,
        "CUDA_VISIBLE_DEVICES": MIG_UUID,
        "HETEROFLOW_SLICE_ID": "41",
        "HETEROFLOW_SLICE_TIER": "mig",
        "HETEROFLOW_SLICE_QOS": "gold",
    }


def test_an_mps_slice_gets_the_client_limits_and_the_daemon_directories():
    env = slice_env("nvidia", a_slice("mps"), mps_pipe="/run/nvidia-mps", mps_log="/var/log/nvidia-mps")
    assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == "2"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvidia-mps"
    assert env["CUDA_MPS_LOG_DIRECTORY"] == "/var/log/nvidia-mps"
    assert env["HETEROFLOW_SLICE_QOS"] == "silver"


def test_a_software_slice_gets_the_limit_variables_and_the_card():
    env = slice_env("nvidia", a_slice("software"), mps_pipe="/p", mps_log="/l")
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env["HETEROFLOW_GPU_MEMORY_LIMIT_MB"] == "10240"
    assert env["HETEROFLOW_GPU_MEMORY_FRACTION"] == "0.250"
    assert env["HETEROFLOW_SLICE_TIER"] == "software" and env["HETEROFLOW_SLICE_QOS"] == "bronze"
    assert not any(name.startswith("CUDA_MPS") for name in env)


def test_a_hami_slice_names_its_vdcu_config():
    env = slice_env("hygon", a_slice("hami", device_id="vdev3"), mps_pipe="/p", mps_log="/l")
    assert env["HIP_VISIBLE_DEVICES"] == "2"
    assert env["HETEROFLOW_VDEV_CONF"] == "/etc/vdev/docker/vdev3.conf"
    assert env["HETEROFLOW_GPU_MEMORY_LIMIT_MB"] == "10240"


def test_the_task_cannot_set_the_slice_variables_itself():
    spec = executor().spec_for(memory_task(a_slice("software")))
    assert spec.env["HETEROFLOW_GPU_MEMORY_LIMIT_MB"] == "10240"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in spec.env
    assert spec.env["MINE"] == "x"
    assert spec.env["HETEROFLOW_SLICE_ID"] == "41"


def test_a_memory_only_task_never_starts_without_a_confirmed_slice():
    for slice_ in (None, a_slice("software", state="issued")):
        with pytest.raises(RuntimeError_, match="only inside a confirmed slice"):
            executor().spec_for(memory_task(slice_))
    # a task with whole cards has no slice and needs none
    spec = executor().spec_for(memory_task(None, gpu_required=1, gpu_memory_mb=None))
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "2"


def test_in_a_container_an_mps_slice_mounts_the_pipe_and_shares_ipc():
    spec = executor("docker").spec_for(memory_task(a_slice("mps")))
    assert Volume("/run/nvidia-mps", "/run/nvidia-mps", False) in spec.volumes
    assert Volume("/var/log/nvidia-mps", "/var/log/nvidia-mps", False) in spec.volumes
    assert spec.ipc_host


def test_in_a_container_a_vdcu_mounts_its_config_where_the_driver_reads_it():
    spec = executor("docker", vendor="hygon").spec_for(memory_task(a_slice("hami", device_id="vdev1")))
    assert Volume("/etc/vdev/vdev1.conf", "/etc/vdev/docker/vdev1.conf", True) in spec.volumes


def test_a_vdcu_is_not_offered_to_a_plain_process():
    with pytest.raises(RuntimeError_, match="only inside a container"):
        executor("process", vendor="hygon").spec_for(memory_task(a_slice("hami", device_id="vdev1")))


SERVING = {
    "engine": "vllm",
    "format": "safetensors",
    "source": "/models/q",
    "args": ["--gpu-memory-utilization", "0.9", "-x"],
}


def test_vllm_in_a_shared_slice_is_told_its_share_of_the_card():
    task = memory_task(a_slice("software"), kind="inference", serving=SERVING, host_port=8001, command=[])
    launched = executor().launched(task, Route(VLLM, "vllm.entrypoints.openai.api_server", "installed"))
    argv = launched["command"]
    assert argv[-2:] == ["--gpu-memory-utilization", "0.250"]
    assert argv.count("--gpu-memory-utilization") == 1 and "-x" in argv
    # MIG: the card it sees is its own, the operator's utilisation stands
    task["slice"] = a_slice("mig", device_id=MIG_UUID)
    argv = executor().launched(task, Route(VLLM, "m", "installed"))["command"]
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    # an engine without the flag is left as it is (it has HETEROFLOW_GPU_MEMORY_FRACTION)
    llama = dict(task, slice=a_slice("software"), serving=dict(SERVING, engine="llama.cpp", args=["-x"]))
    assert "--gpu-memory-utilization" not in executor().launched(llama, Route(LLAMACPP, "m", "i"))["command"]


def test_the_poll_leaves_a_memory_only_task_alone_until_its_slice_is_confirmed(server, caplog):
    client = ServerClient(server.url, "k", attempts=1)
    made = executor(client=client)
    waiting = memory_task(a_slice("software", state="issued"))
    server.answer("/api/v1/tasks", (200, {"results": [waiting]}), (200, {"results": [waiting]}))
    with caplog.at_level("INFO"):
        assert made.poll() == []
        assert made.poll() == []
    assert not [r for r in server.requests if r["method"] == "PUT"]
    assert sum("not started until the slice is confirmed" in m for m in caplog.messages) == 1
    # confirmed: claimed like any task
    server.answer("/api/v1/tasks", (200, {"results": [memory_task(a_slice("software"))]}))
    server.answer("/api/v1/tasks/9", (409, {"error": {"code": "conflict"}}))
    assert made.poll() == []
    (claim,) = [r for r in server.requests if r["method"] == "PUT"]
    assert claim["json"]["status"] == "running"
    made.pool.shutdown(wait=True)
    client.close()
