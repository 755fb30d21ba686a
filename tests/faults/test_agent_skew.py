"""The previous release's agent against this server (version skew, docs/agent.md).

The heartbeat and the task channel are a contract between programs upgraded at different
times: during a rolling upgrade the server is new and most agents are not. The agent of
the previous release (its package exactly as committed at PREVIOUS_RELEASE, taken out of
this repository's history) runs against a whole control plane of this tree: it registers,
beats, and runs a task to the end on the task channel. The other skew, an agent newer than
the server sending fields the server does not know, is pinned by
tests/nodes/test_heartbeat.py (unknown fields accepted, ignored and counted).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests
from django.db import connection

from apps.nodes.models import Node
from apps.scheduler.services import set_plugin_options
from apps.tasks.models import Task
from apps.tenants.services import create_tenant, issue_platform_key
from tests.factories import OperatorFactory
from tests.faults.cluster import ControlPlane
from tests.headers import bearer_http
from tests.live import REPO, agent_log, start_agent, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# The last release that landed before this tree: main at the end of the previous session.
PREVIOUS_RELEASE = "e271aeb9903482e1926ca0ae64cf6bd8f09dca11"


@pytest.fixture
def previous_agent(tmp_path):
    """The previous release's agent package, extracted from git into a folder of its own."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the previous release's agent comes from this repository's history")
    folder = tmp_path / "previous"
    folder.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE, "agent/heteroflow_agent"],
        capture_output=True,
    )
    assert archive.returncode == 0, (
        f"commit {PREVIOUS_RELEASE} is not in this clone (a shallow clone? fetch the history): {archive.stderr!r}"
    )
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    path = folder / "agent"
    found = subprocess.run(
        [sys.executable, "-c", "import heteroflow_agent; print(heteroflow_agent.__file__)"],
        env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert found.stdout.startswith(str(path)), found  # the old package, not this tree's
    return path


def test_the_previous_releases_agent_registers_and_runs_a_task(tmp_path, previous_agent):
    create_tenant(name="Lab", slug="lab")
    set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
    key = issue_platform_key(user=OperatorFactory(username="ops"), name="ops").key
    plane = ControlPlane(tmp_path).start()
    data_dir = tmp_path / "agent"
    data_dir.mkdir()
    agent = start_agent(plane.url, data_dir, PYTHONPATH=str(previous_agent))
    try:
        online = Node.objects.filter(status="online")
        wait_until(online.exists, 90, f"the old agent's node online\n{agent_log(agent)}")
        response = requests.post(
            f"{plane.url}/api/v1/tasks",
            headers=bearer_http(key),
            timeout=30,
            json={
                "tenant": "lab",
                "name": "skew",
                "image": "busybox",
                "command": ["sh", "-c", "echo hello from the previous agent"],
                "gpu_required": 1,
            },
        )
        assert response.status_code == 201, response.text
        task_id = response.json()["id"]
        wait_until(
            lambda: Task.objects.get(pk=task_id).status in ("completed", "failed"),
            120,
            f"the task to end\n{agent_log(agent)}\n{plane.logs()}",
        )
        task = Task.objects.get(pk=task_id)
        assert task.status == "completed", (task.status, task.error_message, agent_log(agent))
        assert "hello from the previous agent" in task.log_tail
        node = Node.objects.get()
        assert node.status == "online" and node.gpu_count >= 1
    finally:
        stop_process(agent)
        plane.stop()
        connection.close()
    assert "Traceback" not in agent_log(agent), agent_log(agent)
