"""An interactive task's app as the agent starts it (heteroflow_agent.interactive): bound
to localhost on the task's host port, the token in the environment and never on the
command line; a shell task only waits; what cannot start says why."""

from __future__ import annotations

import subprocess
import sys

import pytest

from heteroflow_agent.interactive import WAIT, with_app
from heteroflow_agent.runtime.base import RuntimeError_

TASK = {"id": 7, "kind": "interactive", "app": "jupyter", "host_port": 8123, "app_token": "tok-xyz", "env": {"A": "1"}}


def test_jupyter_under_the_process_runtime_runs_under_the_engine_python(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0))
    started = with_app(TASK, runtime_kind="process", python="/opt/py/bin/python")
    assert started["command"][:3] == ["/opt/py/bin/python", "-m", "jupyter_server"]
    assert "--ip=127.0.0.1" in started["command"] and "--port=8123" in started["command"]
    assert "tok-xyz" not in " ".join(started["command"])
    assert started["env"] == {"A": "1", "JUPYTER_TOKEN": "tok-xyz"}


def test_jupyter_in_a_container_is_the_images_and_a_shell_only_waits():
    started = with_app(TASK, runtime_kind="docker", python=sys.executable)
    assert started["command"][:2] == ["jupyter", "server"] and "--port=8123" in started["command"]
    assert with_app(TASK | {"app": "shell"}, runtime_kind="docker", python=sys.executable)["command"] == WAIT


def test_a_shell_task_waits_until_it_is_stopped():
    waiting = subprocess.Popen(WAIT)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(0.5)
        waiting.terminate()
        assert waiting.wait(5) == 0
    finally:
        waiting.kill()


@pytest.mark.parametrize(
    "task,words",
    [
        (TASK | {"app": "vscode"}, "does not know the app 'vscode'"),
        (TASK | {"host_port": None}, "needs its host port"),
    ],
)
def test_what_cannot_start_says_why(task, words):
    with pytest.raises(RuntimeError_, match=words):
        with_app(task, runtime_kind="docker", python=sys.executable)


def test_a_python_without_jupyter_server_is_named():
    with pytest.raises(RuntimeError_, match="jupyter_nonexistent_server is not installed for"):
        from heteroflow_agent import interactive

        interactive.check_python_has(sys.executable, "jupyter_nonexistent_server")
