"""A task inside its slice in a real container (the test engine; skips without one): the
executor's spec for an MPS slice mounts the daemon's pipe and log directories and
shares the host's IPC namespace, and the slice variables are the container's env."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from heteroflow_agent.client import ServerClient
from heteroflow_agent.executor import Executor
from heteroflow_agent.runtime.docker import DockerRuntime

SHOW = (
    "cat {pipe}/control; "
    'echo "$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE $CUDA_VISIBLE_DEVICES '
    '$HETEROFLOW_SLICE_TIER $CUDA_MPS_PIPE_DIRECTORY"; '
    "touch {log}/client; readlink /proc/self/ns/ipc"
)


def wait_exited(runtime, task_id, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        state = runtime.state(task_id)
        if state is not None and not state.running and state.exit_code is not None:
            return state
        assert time.monotonic() < deadline, f"task {task_id} did not exit within {timeout} s: {state}"
        time.sleep(0.05)


@pytest.fixture
def docker(docker_engine):
    return DockerRuntime(timeout=30)


def test_an_mps_slice_in_a_container(docker, docker_task_ids, docker_test_image, docker_test_labels, tmp_path):
    pipe, log = tmp_path / "mps-pipe", tmp_path / "mps-log"
    pipe.mkdir()
    log.mkdir()
    (pipe / "control").write_text("the daemon's pipe\n")
    executor = Executor("n1", ServerClient("http://x", "k"), docker, vendor="nvidia", workers=2)
    executor.mps_pipe, executor.mps_log = str(pipe), str(log)
    task_id = docker_task_ids()
    task = {
        "id": task_id,
        "name": "mps-share",
        "image": docker_test_image,
        "command": ["sh", "-c", SHOW.format(pipe=pipe, log=log)],
        "gpu_required": 0,
        "gpu_memory_mb": 8192,
        "gpu_indices": [1],
        "slice": {
            "id": 5,
            "tier": "mps",
            "qos": "silver",
            "state": "confirmed",
            "gpu_index": 1,
            "memory_mb": 8192,
            "memory_total_mb": 81920,
            "compute_percent": 10,
            "device_id": "GPU-x",
        },
    }
    spec = executor.spec_for(task)
    docker.start(dataclasses.replace(spec, labels={**spec.labels, **docker_test_labels}))
    assert wait_exited(docker, task_id).exit_code == 0
    assert docker.logs_tail(task_id).splitlines() == [
        "the daemon's pipe",
        f"0=8192M 10 1 mps {pipe}",
        os.readlink("/proc/self/ns/ipc"),  # the host's IPC namespace, which the MPS daemon shares
    ]
    assert (log / "client").exists()  # the log directory is the host's, writable
    executor.pool.shutdown(wait=False)
