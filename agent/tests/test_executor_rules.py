"""The executor's rules that need no runtime: volumes, env, GPU visibility, pool size."""

import threading
import time

import pytest

from heteroflow_agent.client import ServerClient
from heteroflow_agent.executor import Executor, time_limit, worker_count
from heteroflow_agent.runtime import RuntimeError_, Volume
from heteroflow_agent.runtime.base import TaskState
from heteroflow_agent.task_spec import checked_volumes, visibility_env


@pytest.mark.parametrize("cpus,expected", [(1, 2), (2, 2), (8, 8), (64, 16)])
def test_the_pool_follows_the_cpus_clamped_2_to_16(cpus, expected):
    assert worker_count(cpus) == expected


def test_volumes_must_be_under_an_allowed_path_and_no_denied_one(tmp_path):
    allowed = tmp_path / "data"
    (allowed / "set").mkdir(parents=True)
    (allowed / "secret").mkdir()
    allow, deny = (str(allowed),), (str(allowed / "secret"),)
    assert checked_volumes([{"host": str(allowed / "set"), "container": "/in", "read_only": True}], allow, deny) == (
        Volume(str(allowed / "set"), "/in", True),
    )
    for bad, problem in [
        ({"host": str(tmp_path / "elsewhere"), "container": "/in"}, "outside the allowed"),
        ({"host": str(allowed / "secret"), "container": "/in"}, "denied"),
        ({"host": str(allowed / "set" / ".." / ".." / "etc"), "container": "/in"}, "outside the allowed"),
        ({"host": str(allowed / "set"), "container": "relative"}, "must be absolute"),
    ]:
        with pytest.raises(RuntimeError_, match=problem):
            checked_volumes([bad], allow, deny)


def test_a_symlink_cannot_lead_out_of_the_allowed_paths(tmp_path):
    allowed = tmp_path / "data"
    allowed.mkdir()
    (allowed / "escape").symlink_to("/etc")
    with pytest.raises(RuntimeError_, match="outside the allowed"):
        checked_volumes([{"host": str(allowed / "escape"), "container": "/in"}], (str(allowed),), ())


@pytest.mark.parametrize(
    "vendor,cards,expected",
    [
        ("nvidia", [3, 1], {"NVIDIA_VISIBLE_DEVICES": "1,3", "CUDA_VISIBLE_DEVICES": "1,3"}),
        ("nvidia", [], {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}),
        ("ascend", [0], {"ASCEND_VISIBLE_DEVICES": "0", "ASCEND_RT_VISIBLE_DEVICES": "0"}),
        ("hygon", [2], {"HIP_VISIBLE_DEVICES": "2"}),
        ("virtual", [0], {}),
    ],
)
def test_gpu_visibility_comes_from_the_allocation(vendor, cards, expected):
    assert visibility_env(vendor, cards) == expected


def test_the_agent_owns_the_visibility_variables_and_drops_env_without_a_value():
    executor = Executor("n1", ServerClient("http://x", "k"), runtime=None, vendor="nvidia", workers=2)
    spec = executor.spec_for(
        {
            "id": 7,
            "name": "train",
            "tenant": "acme",
            "kind": "training",
            "image": "img",
            "command": ["python", "t.py"],
            "env": {"A": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "NVIDIA_VISIBLE_DEVICES": "all", "BARE": None},
            "gpu_indices": [4, 5],
            "volumes": [],
            "host_port": None,
        }
    )
    assert spec.env == {"A": "1", "NVIDIA_VISIBLE_DEVICES": "4,5", "CUDA_VISIBLE_DEVICES": "4,5"}
    assert spec.ipc_host and spec.name == "task-7" and spec.labels["heteroflow.tenant"] == "acme"
    single = executor.spec_for({"id": 8, "kind": "inference", "gpu_indices": [0], "host_port": 8001})
    assert not single.ipc_host and single.env["HETEROFLOW_PORT"] == "8001"
    executor.pool.shutdown()


def test_a_training_task_resumes_from_its_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "data" / "run"
    (run / "epoch-2").mkdir(parents=True)
    (run / "epoch-2" / ".heteroflow_complete").write_text("")
    executor = Executor(
        "n1",
        ServerClient("http://x", "k"),
        runtime=None,
        vendor="nvidia",
        workers=2,
        volume_allow=(str(tmp_path / "data"),),
    )
    task = {
        "id": 9,
        "kind": "training",
        "checkpoint_path": "/ckpt",
        "gpu_indices": [0],
        "volumes": [{"host": str(run), "container": "/ckpt"}],
        "env": {"HETEROFLOW_RESUME_FROM_CHECKPOINT": "/ckpt/forged"},
    }
    assert executor.spec_for(task).env["HETEROFLOW_RESUME_FROM_CHECKPOINT"] == "/ckpt/epoch-2"
    assert "HETEROFLOW_RESUME_FROM_CHECKPOINT" not in executor.spec_for(task | {"kind": "job"}).env
    executor.pool.shutdown()


def test_a_task_whose_secret_is_gone_fails_without_starting():
    executor = Executor("n1", ServerClient("http://x", "k"), runtime=None, vendor="nvidia", workers=2)
    outcome = executor.run({"id": 3, "missing_secrets": ["registry-pw"]}, stop=None)
    assert (outcome.status, outcome.exit_code) == ("failed", None) and "registry-pw" in outcome.error_message
    executor.pool.shutdown()


def make_executor(shm_free_mb):
    return Executor(
        "n1", ServerClient("http://x", "k"), runtime=None, vendor="nvidia", workers=2, shm_free_mb=lambda: shm_free_mb
    )


def test_an_engine_that_would_run_out_of_host_shm_is_refused_before_it_starts():
    task = {"id": 4, "kind": "inference", "image": "vllm/vllm-openai:v0.9.2", "gpu_indices": [0, 1, 2, 3]}
    executor = make_executor(shm_free_mb=2048)
    with pytest.raises(RuntimeError_, match="needs 4096 MB of /dev/shm and the host has 2048 MB free"):
        executor.spec_for(task)
    outcome = executor.run(task, stop=None)
    assert outcome.status == "failed" and "could not start" in outcome.error_message
    assert make_executor(shm_free_mb=8192).spec_for(task).ipc_host  # enough: started with the host's IPC
    assert make_executor(shm_free_mb=1024).spec_for(task | {"labels": {"shm_size_mb": "512"}}).ipc_host
    # a private-registry copy is not the engine image; one card needs no host IPC at all
    assert make_executor(shm_free_mb=0).spec_for(task | {"image": "10.0.0.1:5000/vllm/vllm-openai:v1"})
    assert make_executor(shm_free_mb=0).spec_for(task | {"gpu_indices": [0]}).shm_size_mb is None


def test_shm_size_label_sizes_a_tasks_own_shm():
    spec = make_executor(0).spec_for({"id": 5, "kind": "job", "labels": {"shm_size_mb": "2048"}})
    assert spec.shm_size_mb == 2048 and not spec.ipc_host
    with pytest.raises(RuntimeError_, match="not a whole number"):
        make_executor(0).spec_for({"id": 6, "kind": "job", "labels": {"shm_size_mb": "lots"}})


@pytest.mark.parametrize(
    "task,limit,words",
    [
        ({"timeout_seconds": 60}, 60, "timed out after 60 s"),
        ({"timeout_seconds": 60, "max_duration_seconds": 20}, 20, "ran past its declared duration of 20 s"),
        ({"timeout_seconds": 60, "max_duration_seconds": 90}, 60, "timed out after 60 s"),  # never past the timeout
        ({}, 7200, "timed out after 7200 s"),
    ],
)
def test_a_task_runs_until_its_timeout_or_the_shorter_duration_it_declared(task, limit, words):
    assert time_limit(task)[0] == limit and time_limit(task)[1].startswith(words)


class NeverEnding:
    """A runtime whose task runs until it is stopped."""

    def __init__(self):
        self.stopped = []

    def state(self, task_id):
        return TaskState(task_id, running=not self.stopped, exit_code=None if not self.stopped else 137)

    def stop(self, task_id, grace):
        self.stopped.append(task_id)

    def logs_tail(self, task_id):
        return "step 9"


def test_a_task_past_its_declared_duration_is_stopped_and_fails_saying_so():
    runtime = NeverEnding()
    executor = Executor("n1", ServerClient("http://x", "k"), runtime=runtime, vendor="nvidia", workers=2,
                        watch_interval=0.01, stop_poll_seconds=3600)  # fmt: skip
    task = {"id": 9, "kind": "job", "timeout_seconds": 60, "max_duration_seconds": 1}
    started = time.monotonic() - 1.5  # it has run 1.5 s
    outcome = executor.watch(task, threading.Event(), started)
    assert runtime.stopped == [9]
    assert outcome.status == "failed" and outcome.exit_code == 124
    assert outcome.error_message == "ran past its declared duration of 1 s (max_duration_seconds)"
    executor.pool.shutdown()
