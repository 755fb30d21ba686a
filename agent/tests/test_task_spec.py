"""task_spec on its own: a task payload and the node's rules in, what the runtime
launches out (no executor, no server, no runtime)."""

from __future__ import annotations

import pytest

from heteroflow_agent.engines.router import LLAMACPP, VLLM, Route
from heteroflow_agent.runtime import RuntimeError_, Volume
from heteroflow_agent.task_spec import NodeRules, build, container_labels, inference_engine, with_engine

NVIDIA_DOCKER = NodeRules(vendor="nvidia", runtime_kind="docker", mps_pipe="/tmp/mps-pipe", mps_log="/tmp/mps-log")
NVIDIA_PROCESS = NodeRules(vendor="nvidia", runtime_kind="process")
CONFIRMED = {"state": "confirmed", "id": 3, "gpu_index": 1, "memory_mb": 4096, "memory_total_mb": 16384}


def task(**fields) -> dict:
    return {"id": 7, "kind": "job", **fields}


@pytest.mark.parametrize(
    "fields,env",
    [
        ({}, {"NVIDIA_VISIBLE_DEVICES": "void", "CUDA_VISIBLE_DEVICES": ""}),
        ({"env": {"A": "1", "N": 3, "": "x", "NONE": None}}, {"A": "1"}),
        ({"gpu_indices": [2, 0], "env": {"CUDA_VISIBLE_DEVICES": "7"}}, {"CUDA_VISIBLE_DEVICES": "0,2"}),
        ({"env": {"HETEROFLOW_SLICE_ID": "forged", "CUDA_MPS_PIPE_DIRECTORY": "/x"}}, {}),
        ({"host_port": 8001}, {"HETEROFLOW_PORT": "8001"}),
        ({"env": {"HETEROFLOW_RESUME_FROM_CHECKPOINT": "/forged"}}, {}),
        (
            {"gpu_required": 0, "gpu_memory_mb": 4096, "slice": {**CONFIRMED, "tier": "software"}},
            {"HETEROFLOW_SLICE_TIER": "software", "HETEROFLOW_GPU_MEMORY_FRACTION": "0.250"},
        ),
    ],
)
def test_the_env_is_the_tasks_own_under_the_agents_variables(fields, env):
    spec, decision = build(task(**fields), NVIDIA_DOCKER)
    assert env.items() <= spec.env.items() and decision == ""
    assert "HETEROFLOW_RESUME_FROM_CHECKPOINT" not in spec.env and "N" not in spec.env
    if "HETEROFLOW_SLICE_TIER" not in env:
        assert "HETEROFLOW_SLICE_ID" not in spec.env and "CUDA_MPS_PIPE_DIRECTORY" not in spec.env


@pytest.mark.parametrize(
    "fields,rules,ipc_host",
    [
        ({"kind": "training", "gpu_indices": [0, 1]}, NVIDIA_DOCKER, True),
        ({"kind": "inference", "gpu_indices": [0, 1]}, NVIDIA_DOCKER, True),
        ({"kind": "job", "gpu_indices": [0, 1]}, NVIDIA_DOCKER, False),
        ({"kind": "training", "gpu_indices": [0]}, NVIDIA_DOCKER, False),
        ({"gpu_required": 0, "gpu_memory_mb": 1024, "slice": {**CONFIRMED, "tier": "mps"}}, NVIDIA_DOCKER, True),
        ({"gpu_required": 0, "gpu_memory_mb": 1024, "slice": {**CONFIRMED, "tier": "mps"}}, NVIDIA_PROCESS, False),
    ],
)
def test_the_hosts_ipc_namespace_for_several_cards_and_for_an_mps_client(fields, rules, ipc_host):
    assert build(task(**fields), rules)[0].ipc_host is ipc_host


@pytest.mark.parametrize(
    "fields,rules,problem",
    [
        ({"gpu_required": 0, "gpu_memory_mb": 1024}, NVIDIA_DOCKER, "only inside a confirmed slice"),
        (
            {"gpu_required": 0, "gpu_memory_mb": 1024, "slice": {**CONFIRMED, "state": "requested"}},
            NVIDIA_DOCKER,
            "only inside a confirmed slice",
        ),
        (
            {"gpu_required": 0, "gpu_memory_mb": 1024, "slice": {**CONFIRMED, "tier": "hami", "device_id": "vdev1"}},
            NodeRules(vendor="hygon", runtime_kind="process"),
            "only inside a container",
        ),
        ({"volumes": [{"host": "/etc", "container": "/in"}]}, NVIDIA_DOCKER, "outside the allowed host paths"),
        ({"labels": {"shm_size_mb": "a lot"}}, NVIDIA_DOCKER, "not a whole number"),
        (
            {"kind": "inference", "image": "vllm/vllm-openai:v0.9.2", "gpu_indices": [0, 1]},
            NodeRules(vendor="nvidia", runtime_kind="docker", shm_free_mb=lambda: 100),
            "needs 2048 MB of /dev/shm and the host has 100 MB free",
        ),
    ],
)
def test_a_task_that_cannot_start_here_is_refused_with_why(fields, rules, problem):
    with pytest.raises(RuntimeError_, match=problem):
        build(task(**fields), rules)


def test_the_agents_slice_mounts_are_not_subject_to_the_volume_lists():
    fields = {"gpu_required": 0, "gpu_memory_mb": 1024, "slice": {**CONFIRMED, "tier": "mps"}}
    pipe, log = Volume("/tmp/mps-pipe", "/tmp/mps-pipe", False), Volume("/tmp/mps-log", "/tmp/mps-log", False)
    assert build(task(**fields), NVIDIA_DOCKER)[0].volumes == (pipe, log)  # /tmp is on no allow-list
    assert build(task(**fields), NVIDIA_PROCESS)[0].volumes == ()  # a process shares the host's paths
    spec, _ = build(task(labels={"shm_size_mb": "512"}), NVIDIA_DOCKER)
    assert (spec.shm_size_mb, spec.ipc_host, spec.volumes) == (512, False, ())


def test_a_resume_point_given_by_the_task_is_passed_as_is_and_the_decision_comes_back():
    spec, decision = build(
        task(kind="training", checkpoint_path="/ckpt", resume_from_checkpoint="/ckpt/step-9"), NVIDIA_DOCKER
    )
    assert spec.env["HETEROFLOW_RESUME_FROM_CHECKPOINT"] == "/ckpt/step-9"
    assert decision == "resume point given by the task: not probed"
    assert build(task(kind="training", checkpoint_path="/ckpt"), NVIDIA_DOCKER)[1].startswith("checkpoint path /ckpt")


def test_the_spec_carries_the_tasks_image_command_port_and_labels():
    spec, _ = build(
        task(name="t", tenant="acme", image="img:1", command=["run", "it"], host_port=9000, labels={"team": "x"}),
        NVIDIA_DOCKER,
    )
    assert (spec.task_id, spec.image, spec.command, spec.host_port) == (7, "img:1", ["run", "it"], 9000)
    assert spec.labels == {"heteroflow.task-name": "t", "heteroflow.tenant": "acme", "heteroflow.label.team": "x"}
    long = container_labels({"name": "n" * 300, "labels": {"k" * 200: "v" * 2000}})
    assert len(long["heteroflow.task-name"]) == 200 and all(len(k) <= 128 and len(v) <= 1024 for k, v in long.items())


@pytest.mark.parametrize(
    "image,engine",
    [
        ("vllm/vllm-openai:v0.9.2", VLLM),
        ("vllm/vllm-openai@sha256:" + "0" * 64, VLLM),
        ("vllm/vllm-openai", VLLM),
        ("ghcr.io/ggml-org/llama.cpp:server", LLAMACPP),
        ("10.0.0.1:5000/vllm/vllm-openai:v1", ""),
        ("busybox", ""),
        ("", ""),
    ],
)
def test_an_image_is_an_engine_by_its_exact_repository_name(image, engine):
    assert inference_engine(image) == engine


SERVING = {"serving": {"engine": "llama.cpp", "model": "tiny", "format": "gguf", "source": "/models/tiny.gguf"}}


@pytest.mark.parametrize(
    "runtime_kind,fields,image,command_starts",
    [
        ("process", {}, None, ["/opt/py", "-m", "llama_cpp.server"]),
        ("docker", {}, "ghcr.io/ggml-org/llama.cpp:server", ["--model", "/models/tiny.gguf"]),
        ("docker", {"command": ["my", "server"]}, "ghcr.io/ggml-org/llama.cpp:server", ["my", "server"]),
    ],
)
def test_a_routed_engine_is_launched_as_the_runtime_runs_it(runtime_kind, fields, image, command_starts):
    routed = Route(LLAMACPP, "ghcr.io/ggml-org/llama.cpp:server", "installed")
    launched = with_engine(
        task(kind="inference", host_port=8080, **SERVING, **fields),
        routed,
        runtime_kind=runtime_kind,
        engine_python="/opt/py",
    )
    assert launched.get("image") == image
    assert launched["command"][: len(command_starts)] == command_starts
