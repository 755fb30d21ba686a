"""What the running engines have loaded: /v1/models read from real local servers, merged
into discovered_models, never holding up a beat; and the heteroflow.cache/models label."""

import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from heteroflow_agent.client import ServerClient
from heteroflow_agent.config import AgentConfig
from heteroflow_agent.engines.loaded import LoadedModels, merge, read_models
from heteroflow_agent.executor import Executor
from heteroflow_agent.heartbeat import CACHED_MODELS_LABEL, LABEL_MAX, Heartbeat, TaskReport, cached_models_label
from heteroflow_agent.runtime.base import TaskState

MODELS = {
    "object": "list",
    "data": [{"id": "qwen-tiny", "object": "model", "root": "/data/models/qwen-tiny", "owned_by": "vllm"}],
}


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture
def silent_port():
    """A port that accepts connections (the kernel's backlog) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield listener.getsockname()[1]
    listener.close()


@pytest.fixture
def closed_port():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


def test_a_running_engine_reports_what_it_has_loaded(server):
    server.answer("/v1/models", (200, MODELS))
    assert read_models(port_of(server.url)) == MODELS["data"]
    assert server.requests[0]["method"] == "GET"


def test_an_engine_that_is_not_up_or_not_an_openai_server_reports_nothing(server, closed_port, silent_port):
    server.answer("/v1/models", (503, {"error": "loading"}), (200, {"unexpected": True}), (200, {"data": [{"x": 1}]}))
    port = port_of(server.url)
    assert read_models(port) is None  # still loading
    assert read_models(port) is None  # no data list
    assert read_models(port) == []  # entries without an id are dropped
    assert read_models(closed_port) is None
    began = time.monotonic()
    assert read_models(silent_port, timeout=0.3) is None
    assert time.monotonic() - began < 2


def test_loaded_models_are_merged_into_the_scanned_ones():
    scanned = [
        {"name": "qwen-tiny", "path": "/data/models/qwen-tiny", "size_bytes": 10, "format": "safetensors"},
        {"name": "llama", "path": "/data/models/llama.gguf", "size_bytes": 20, "format": "gguf"},
    ]
    served = [
        {"name": "qwen-tiny", "path": "/data/models/qwen-tiny", "served": True, "task_id": 4, "port": 30001},
        {"name": "Qwen/Qwen3-8B", "path": "Qwen/Qwen3-8B", "served": True, "task_id": 5, "port": 30002},
    ]
    merged = merge(scanned, served)
    assert merged == [
        {**scanned[0], "served": True, "task_id": 4, "port": 30001},
        scanned[1],
        served[1],  # loaded from a hub id: not on this node's disk, still what it serves
    ]
    # cut to the limit, what is served is kept first
    assert [m["name"] for m in merge(scanned, served, limit=2)] == ["qwen-tiny", "Qwen/Qwen3-8B"]


def test_the_beat_never_waits_for_an_engine_and_a_stopped_task_drops_out(server, silent_port):
    server.answer("/v1/models", *[(200, MODELS)] * 5)
    reader = LoadedModels(timeout=0.5)
    ports = {4: port_of(server.url), 9: silent_port}
    began = time.monotonic()
    assert reader.latest(ports) == []  # nothing read yet; the read runs in the background
    assert time.monotonic() - began < 0.2
    reader.wait(5)
    assert [(e["task_id"], e["name"], e["path"]) for e in reader.latest(ports)] == [
        (4, "qwen-tiny", "/data/models/qwen-tiny")
    ]
    reader.wait(5)
    assert reader.latest({9: silent_port}) == []  # task 4 stopped serving: gone at once


@dataclass
class Detection:
    vendor: str = "nvidia"
    gpus: list = field(default_factory=list)
    collect_failures: list = field(default_factory=list)
    collector_error: str = ""
    capabilities: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    is_container: bool = False


class NoEngine:
    def state(self):
        from heteroflow_agent.collect import EngineState

        return EngineState(False, "none")


def test_the_heartbeat_sends_served_models_and_the_cache_label(server, tmp_path):
    server.answer("/v1/models", *[(200, MODELS)] * 5)
    (tmp_path / "llama-tiny.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    config = AgentConfig(
        server_url="http://unused", api_key="k", node_id="n1", data_dir=Path(tmp_path), model_scan_dirs=(str(tmp_path),)
    )
    serving = {12: port_of(server.url)}
    beat = Heartbeat(
        config,
        ServerClient("http://unused", "k"),
        detect_gpus=Detection,
        engine=NoEngine(),
        tasks=lambda: TaskReport(live_task_ids=[12], serving=serving),
    )
    first = beat.payload()
    assert first["labels"][CACHED_MODELS_LABEL] == "llama-tiny"
    beat.loaded.wait(5)
    models = beat.payload()["discovered_models"]
    assert [m["name"] for m in models] == ["llama-tiny", "qwen-tiny"]
    assert models[1] == {
        "name": "qwen-tiny",
        "path": "/data/models/qwen-tiny",
        "served": True,
        "task_id": 12,
        "port": port_of(server.url),
    }
    assert "qwen-tiny" not in beat.payload()["labels"][CACHED_MODELS_LABEL]  # loaded, not in the cache


def test_the_cache_label_is_cut_at_a_whole_name_and_commas_cannot_split_a_name():
    many = [{"name": f"model-{i:04d}", "path": f"/m/{i}"} for i in range(600)]
    label = cached_models_label(many)
    names = label.split(", ")
    assert len(label) <= LABEL_MAX < len(label) + len(", model-9999")  # as many whole names as fit
    assert names == [f"model-{i:04d}" for i in range(len(names))]
    assert cached_models_label([{"name": "a,b", "path": "/x"}, {"name": "a,b", "path": "/y"}]) == "a b"
    assert cached_models_label([]) == ""


class Running:
    kind = "process"

    def __init__(self):
        self.seen = threading.Event()

    def state(self, task_id):
        self.seen.set()
        return TaskState(task_id, True)

    def tasks(self):
        return {}


def test_the_executor_knows_which_inference_tasks_serve_on_which_port():
    runtime = Running()
    executor = Executor(
        "n1", ServerClient("http://x", "k"), runtime=runtime, vendor="nvidia", workers=2, stop_poll_seconds=60
    )
    stop = threading.Event()
    task = {"id": 21, "kind": "inference", "host_port": 30005}
    executor.active[21] = stop
    executor.pool.submit(executor._work, 21, lambda: executor.watch(task, stop, time.monotonic()))
    batch = {"id": 22, "kind": "batch"}
    executor.pool.submit(executor._work, 22, lambda: executor.watch(batch, stop, time.monotonic()))
    assert runtime.seen.wait(5)
    deadline = time.monotonic() + 5
    while executor.report().serving != {21: 30005} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert executor.report().serving == {21: 30005}
    stop.set()
    executor.close()
    assert executor.report().serving == {}
