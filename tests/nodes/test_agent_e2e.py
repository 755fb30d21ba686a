"""The real agent against the real control plane: `heteroflow-agent` as a process, the
server under uvicorn (the heartbeat route is ASGI, in front of Django), the test
database. The first beat registers the node, beats keep it online, and once the agent
is stopped the health checker moves it to suspect, then offline."""

import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psutil
import pytest
import requests
from django.conf import settings
from django.db import connection

from apps.nodes.models import Node
from apps.nodes.services import refresh_node_statuses

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def control_plane():
    """uvicorn serving heteroflow.asgi on the test database."""
    port = free_port()
    # the same server as this test run, but the test database
    test_database = urlunsplit(urlsplit(os.environ["DATABASE_URL"])._replace(path="/" + connection.settings_dict["NAME"]))
    env = os.environ | {
        "DATABASE_URL": test_database,
        "HETEROFLOW_ENV": "test",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "heteroflow.asgi:application", "--host", "127.0.0.1", "--port", str(port),
         "--lifespan", "off", "--no-proxy-headers", "--log-level", "warning"],
        cwd=REPO, env=env, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def up():
        try:
            return requests.get(f"{url}/health", timeout=1).status_code in (200, 503)
        except requests.RequestException:
            return False

    try:
        wait_until(up, 60, "the control plane")
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def start_agent(url: str, data_dir: Path, **extra) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")} | {
        "HETEROFLOW_SERVER_URL": url,
        "HETEROFLOW_AGENT_KEY": settings.HETEROFLOW_AGENT_SECRET,
        "HETEROFLOW_AGENT_DATA_DIR": str(data_dir),
        "HETEROFLOW_HEARTBEAT_INTERVAL": "5",
        "HETEROFLOW_MODEL_SCAN_DIRS": str(data_dir / "models"),
        # no container engine on the test machines: the operator allows plain processes
        "HETEROFLOW_ALLOW_PROCESS_RUNTIME": "true",
        **extra,
    }
    return subprocess.Popen([sys.executable, "-m", "heteroflow_agent"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_agent_registers_its_node_keeps_it_online_and_its_silence_is_noticed(control_plane, tmp_path):
    agent = start_agent(control_plane, tmp_path)
    try:
        node = wait_until(lambda: Node.objects.filter(last_heartbeat_at__isnull=False).first(), 30, "the first heartbeat")
        assert node.pk == (tmp_path / "node-id").read_text().strip()
        assert node.status == "online" and node.agent_version == "dev" and node.agent_git_commit == "unknown"
        assert node.executable and node.exec_mode in ("docker", "process")
        assert node.gpus.count() >= 1  # a virtual card on a machine without GPUs
        # it only calls out: no listening socket of any kind
        assert not [c for c in psutil.Process(agent.pid).net_connections(kind="all") if c.status == psutil.CONN_LISTEN]
        first_beat = node.last_heartbeat_at
        wait_until(lambda: Node.objects.get(pk=node.pk).last_heartbeat_at > first_beat, 15, "a second heartbeat")
    finally:
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=30)
    assert agent.returncode == 0, output
    assert "starting: node" in output and "stopped" in output

    last = Node.objects.get(pk=node.pk).last_heartbeat_at
    refresh_node_statuses(now=last + timedelta(seconds=31))
    assert Node.objects.get(pk=node.pk).status == "suspect"
    refresh_node_statuses(now=last + timedelta(seconds=61))
    assert Node.objects.get(pk=node.pk).status == "offline"


def test_a_wrong_key_is_a_configuration_error_logged_once(control_plane, tmp_path):
    agent = start_agent(control_plane, tmp_path, HETEROFLOW_AGENT_KEY="not-the-key-" * 3, HETEROFLOW_HEARTBEAT_INTERVAL="5")
    try:
        time.sleep(7)  # two beats
    finally:
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=30)
    assert output.count("configuration error") == 1, output
    assert not Node.objects.exists()
