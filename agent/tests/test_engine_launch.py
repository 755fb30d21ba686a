"""The launch table (engines/launch.py): the command line each engine gets for a task's
`serving`, the install probe of the process runtime, and the executor's use of both (a
fake llama.cpp module stands in for the engine; tests/faults/test_inference_engine.py
runs the real one)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from heteroflow_agent.client import ServerClient
from heteroflow_agent.engines import launch
from heteroflow_agent.engines.launch import (
    LaunchError,
    ProcessEngine,
    container_argv,
    installed_engines,
    process_argv,
    serving_of,
)
from heteroflow_agent.engines.loaded import LoadedModels
from heteroflow_agent.engines.router import LLAMACPP, MINDIE, SGLANG, VLLM, EngineRouter
from heteroflow_agent.executor import Executor, health_probe
from heteroflow_agent.runtime.process import ProcessRuntime


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SERVING = {"engine": "llama.cpp", "model": "tiny", "format": "gguf", "source": "/models/tiny.gguf", "args": ["-x"]}


def test_the_process_launch_of_llama_cpp_is_its_openai_server_on_the_host_port():
    assert process_argv(LLAMACPP, "/opt/py/bin/python", SERVING, 8001) == [
        "/opt/py/bin/python",
        "-m",
        "llama_cpp.server",
        # a probe or a second client must not cut a user's stream short
        "--interrupt_requests",
        "false",
        "--model",
        "/models/tiny.gguf",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--model_alias",
        "tiny",
        "-x",
    ]


def test_the_operator_may_turn_llama_cpps_interruptions_back_on():
    argv = process_argv(LLAMACPP, "py", {**SERVING, "args": ["--interrupt_requests", "true"]}, 8001)
    # the engine's parser keeps the last value: the operator's
    assert argv[3:5] == ["--interrupt_requests", "false"] and argv[-2:] == ["--interrupt_requests", "true"]


def test_vllm_and_sglang_as_processes_name_the_model_their_own_way():
    vllm = process_argv(VLLM, "py", {**SERVING, "args": []}, 8002)
    assert vllm[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert vllm[3:5] == ["--model", "/models/tiny.gguf"] and vllm[-2:] == ["--served-model-name", "tiny"]
    sglang = process_argv(SGLANG, "py", {**SERVING, "args": []}, 8002)
    assert sglang[2] == "sglang.launch_server" and sglang[3] == "--model-path"


def test_a_serving_without_a_model_name_gets_no_alias():
    argv = process_argv(LLAMACPP, "py", {"engine": "llama.cpp", "source": "/m.gguf"}, 8000)
    assert "--model_alias" not in argv and argv[-2:] == ["--port", "8000"]


@pytest.mark.parametrize(
    ("engine", "serving", "port", "why"),
    [
        (LLAMACPP, {**SERVING, "source": ""}, 8000, "serving.source is empty"),
        (LLAMACPP, {**SERVING, "args": "-x"}, 8000, "serving.args must be a list of strings"),
        (LLAMACPP, {**SERVING, "args": [1]}, 8000, "serving.args must be a list of strings"),
        (LLAMACPP, SERVING, None, "no host port"),
        (MINDIE, SERVING, 8000, "mindie cannot run as a plain process"),
    ],
)
def test_a_serving_that_cannot_be_launched_says_why(engine, serving, port, why):
    with pytest.raises(LaunchError, match=why):
        process_argv(engine, "py", serving, port)


def test_container_launches_are_the_images_own_command_lines():
    assert container_argv(LLAMACPP, SERVING, 8003) == [
        "--model",
        "/models/tiny.gguf",
        "--host",
        "0.0.0.0",
        "--port",
        "8003",
        "--alias",
        "tiny",
        "-x",
    ]
    assert container_argv(SGLANG, SERVING, 8003)[:4] == ["python3", "-m", "sglang.launch_server", "--model-path"]
    assert container_argv(VLLM, SERVING, 8003)[0] == "--model"
    assert container_argv(MINDIE, SERVING, 8003) == ["-x"]  # no known command line: the args alone


def test_serving_is_read_from_the_task_or_from_an_older_servers_top_level_keys():
    assert serving_of({"serving": SERVING, "engine": "vllm"}) == SERVING
    assert serving_of({"engine": "auto", "model_format": "gguf"}) == {"engine": "auto", "format": "gguf"}
    assert serving_of({"serving": {}}) == {} and serving_of({}) == {}


# --- the install probe -----------------------------------------------------------------


def fake_engine_tree(root: Path, version: str = "1.2.3") -> Path:
    """A site directory where llama-cpp-python seems installed: its modules (the server's
    __main__ serves /v1/models on --port, like the real one) and its dist-info."""
    package = root / "llama_cpp" / "server"
    package.mkdir(parents=True)
    (root / "llama_cpp" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(
        "import argparse, json\n"
        "from http.server import BaseHTTPRequestHandler, HTTPServer\n"
        "p = argparse.ArgumentParser()\n"
        "for flag in ('--model', '--host', '--port', '--model_alias'):\n"
        "    p.add_argument(flag)\n"
        "a, _ = p.parse_known_args()\n"
        "body = json.dumps({'object': 'list', 'data': [{'id': a.model_alias, 'object': 'model'}]}).encode()\n"
        "class H(BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if self.path == '/v1/models' else 404)\n"
        "        self.send_header('Content-Length', str(len(body)))\n"
        "        self.end_headers()\n"
        "        self.wfile.write(body)\n"
        "    def log_message(self, *args):\n"
        "        pass\n"
        "print('serving', a.model, 'as', a.model_alias, flush=True)\n"
        "HTTPServer((a.host, int(a.port)), H).serve_forever()\n"
    )
    for extra in ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings"):
        (root / extra).mkdir()
        (root / extra / "__init__.py").write_text("")
    info = root / f"llama_cpp_python-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {version}\n")
    return root


def engine_python(tmp_path: Path, site: Path) -> str:
    """An engine interpreter that is not the agent's: this Python with `site` as its only
    place for packages (-S: not this environment's site-packages, where a real
    llama-cpp-python may be installed)."""
    wrapper = tmp_path / "engine-python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" -S "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_another_interpreter_is_asked_which_engines_it_has_and_their_versions(tmp_path):
    python = engine_python(tmp_path, fake_engine_tree(tmp_path / "site"))
    assert installed_engines(python, [LLAMACPP, VLLM]) == ([LLAMACPP], {LLAMACPP: "1.2.3"})


def test_an_engine_missing_one_of_its_servers_modules_is_not_installed(tmp_path):
    site = fake_engine_tree(tmp_path / "site")
    (site / "sse_starlette" / "__init__.py").unlink()
    (site / "sse_starlette").rmdir()
    assert installed_engines(engine_python(tmp_path, site), [LLAMACPP]) == ([], {})


def test_an_interpreter_that_does_not_answer_has_no_engines(tmp_path):
    assert installed_engines("/bin/false") == ([], {})
    assert installed_engines(str(tmp_path / "no-such-python")) == ([], {})


def test_the_agents_own_interpreter_is_asked_in_process(monkeypatch):
    monkeypatch.setitem(
        launch.PROCESS_ENGINES, "fake", ProcessEngine("json.tool", ("json",), "pytest", "--m", "--a", ("*",))
    )
    monkeypatch.setitem(
        launch.PROCESS_ENGINES, "absent", ProcessEngine("x", ("no_such_module_here",), "x", "--m", "--a", ("*",))
    )
    engines, versions = installed_engines(sys.executable, ["fake", "absent"])
    assert engines == ["fake"] and versions["fake"] == __import__("pytest").__version__


def test_the_process_router_chooses_among_installed_modules_or_says_what_is_missing():
    probe = {"result": ([LLAMACPP], {LLAMACPP: "0.3.36"})}
    router = EngineRouter("virtual", lambda: probe["result"], runtime="process")
    chosen = router.choose("gguf")
    assert (chosen.engine, chosen.image) == (LLAMACPP, "llama_cpp.server:0.3.36")
    probe["result"] = ([], {})
    refused = router.choose("gguf")
    assert refused.refused
    assert "python module llama_cpp.server not installed for the engine interpreter" in refused.reason
    nvidia = EngineRouter("nvidia", lambda: ([VLLM], {VLLM: "0.9"}), runtime="process")
    assert nvidia.choose("safetensors").image == "vllm.entrypoints.openai.api_server:0.9"
    assert nvidia.choose("om").refused  # MindIE runs from its image only


# --- the executor ------------------------------------------------------------------------


class ProcessStub:
    kind = "process"


def executor_with(runtime, probe, python="py") -> Executor:
    executor = Executor("n1", ServerClient("http://x", "k"), runtime=runtime, workers=2, engine_python=python)
    executor.router = EngineRouter("virtual", lambda: probe, runtime="process")
    return executor


def test_a_process_inference_task_with_serving_gets_the_engines_command_line():
    executor = executor_with(ProcessStub(), ([LLAMACPP], {LLAMACPP: "0.3.36"}), python="/opt/py")
    task = {"id": 9, "kind": "inference", "image": "", "command": [], "host_port": 8004, "serving": SERVING}
    routed = executor.route(task)
    assert routed.engine == LLAMACPP
    assert executor.launched(task, routed)["command"] == process_argv(LLAMACPP, "/opt/py", SERVING, 8004)
    assert executor.route({**task, "command": ["my-server"]}) is None  # its own command is kept
    assert executor.route({**task, "serving": {}}) is None
    assert executor.route({**task, "kind": "job"}) is None
    executor.close()


def test_a_container_inference_task_gets_the_routed_image_and_its_servers_command_line():
    class DockerStub:
        kind = "docker"

    executor = Executor("n1", ServerClient("http://x", "k"), runtime=DockerStub(), vendor="nvidia", workers=2)
    executor.router = EngineRouter("nvidia", lambda: ([VLLM], {VLLM: "v1"}))
    serving = {"engine": "auto", "model": "qwen", "format": "safetensors", "source": "/models/qwen", "args": []}
    task = {"id": 3, "kind": "inference", "image": "auto", "command": [], "host_port": 8006, "serving": serving}
    launched = executor.launched(task, executor.route(task))
    assert launched["image"] == "vllm/vllm-openai:v1"
    assert launched["command"] == container_argv(VLLM, serving, 8006)
    own = executor.launched({**task, "command": ["--my", "flags"]}, executor.route(task))
    assert own["command"] == ["--my", "flags"]  # the task's own command line is kept
    assert executor.route({**task, "image": "my/own:image"}) is None
    executor.close()


def test_a_serving_task_whose_engine_is_not_installed_fails_saying_so():
    executor = executor_with(ProcessStub(), ([], {}))
    task = {"id": 9, "kind": "inference", "image": "", "command": [], "host_port": 8004, "serving": SERVING}
    outcome = executor.run(task, threading.Event())
    assert outcome.status == "failed"
    assert outcome.error_message.startswith("could not start: llama.cpp cannot serve gguf here")
    assert "python module llama_cpp.server not installed" in outcome.error_message
    bad = executor_with(ProcessStub(), ([LLAMACPP], {})).run(
        {**task, "serving": {**SERVING, "source": ""}}, threading.Event()
    )
    assert bad.error_message == "could not start: serving.source is empty: the engine has no model to load"
    executor.close()


def test_the_health_probe_defaults_to_v1_models_on_the_host_port():
    served = {"kind": "inference", "host_port": 8005, "serving": SERVING}
    assert health_probe(served) == {"type": "http", "path": "/v1/models", "port": 8005}
    assert health_probe({**served, "health_probe": {"path": "/health"}}) == {"path": "/health", "port": 8005}
    own = {"type": "tcp", "port": 9000}
    assert health_probe({**served, "health_probe": own}) == own
    assert health_probe({**served, "host_port": None}) is None
    assert health_probe({"kind": "inference", "host_port": 8005}) is None  # no serving, no probe: as before
    assert health_probe({**served, "kind": "job"}) is None


def test_the_executor_launches_the_engine_probes_it_healthy_and_reads_what_it_loaded(tmp_path, server):
    """The process runtime for real, with a stand-in llama.cpp module under another
    interpreter: the launch, the /v1/models health probe and the loaded-models read."""
    python = engine_python(tmp_path, fake_engine_tree(tmp_path / "site"))
    server.default = (200, {"status": "running"}, {})
    runtime = ProcessRuntime(tmp_path / "tasks")
    executor = Executor(
        "n1", ServerClient(server.url, "k"), runtime, workers=2, engine_python=python, stop_poll_seconds=0.2
    )
    executor.router = EngineRouter("virtual", lambda: installed_engines(python), runtime="process")
    port = free_port()
    task = {"id": 41, "kind": "inference", "image": "", "command": [], "host_port": port, "serving": SERVING}
    stop = threading.Event()
    worker = threading.Thread(target=executor.run, args=(task, stop), daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not executor.report().task_health:
            time.sleep(0.1)
        while time.monotonic() < deadline and not executor.report().task_health[0]["healthy"]:
            time.sleep(0.1)
        report = executor.report()
        assert report.task_health == [{"task_id": 41, "healthy": True}], runtime.logs_tail(41)
        assert report.serving == {41: port} and report.live_task_ids == [41]
        loaded = LoadedModels().read_now(report.serving)
        assert loaded == [{"name": "tiny", "path": "tiny", "served": True, "task_id": 41, "port": port}]
        record = json.loads((tmp_path / "tasks" / "task-41" / "task.json").read_text())
        assert record["command"] == process_argv(LLAMACPP, python, SERVING, port)
        assert "serving /models/tiny.gguf as tiny" in runtime.logs_tail(41)
    finally:
        stop.set()
        worker.join(10)
        runtime.stop(41, 1)
        runtime.remove(41)
        executor.close()
