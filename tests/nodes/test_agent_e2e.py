"""The real agent against the real control plane: `heteroflow-agent` as a process, the
server under uvicorn (the heartbeat route is ASGI, in front of Django), the test
database. The first beat registers the node, beats keep it online; a stopped agent says
goodbye (offline at once), and one that dies silently is moved by the health checker to
suspect, then offline."""

import signal
from datetime import timedelta

import psutil
import pytest

from apps.nodes.models import Node
from apps.nodes.services import refresh_node_statuses
from tests.live import agent_log, agent_output, start_agent, start_control_plane, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def control_plane():
    server, url = start_control_plane()
    try:
        yield url
    finally:
        stop_process(server)


def test_the_agent_registers_its_node_keeps_it_online_and_its_silence_is_noticed(control_plane, tmp_path):
    agent = start_agent(control_plane, tmp_path)
    try:
        node = wait_until(
            lambda: Node.objects.filter(last_heartbeat_at__isnull=False).first(), 30, "the first heartbeat"
        )
        assert node.pk == (tmp_path / "node-id").read_text().strip()
        assert node.status == "online" and node.agent_version == "dev" and node.agent_git_commit == "unknown"
        assert node.executable and node.exec_mode in ("docker", "process")
        assert node.gpus.count() >= 1  # a virtual card on a machine without GPUs
        # it only calls out: no listening socket of any kind
        assert not [c for c in psutil.Process(agent.pid).net_connections(kind="all") if c.status == psutil.CONN_LISTEN]
        first_beat = node.last_heartbeat_at
        wait_until(lambda: Node.objects.get(pk=node.pk).last_heartbeat_at > first_beat, 15, "a second heartbeat")
    finally:
        output = agent_output(agent, timeout=60)
    assert agent.returncode == 0, output
    assert "starting: node" in output and "going offline" in output and "stopped" in output
    assert Node.objects.get(pk=node.pk).status == "offline"  # the farewell beat: at once
    refresh_node_statuses()
    assert Node.objects.get(pk=node.pk).status == "offline"  # and the health checker agrees

    # an agent that dies without a word: its silence makes the node suspect, then offline
    agent = start_agent(control_plane, tmp_path)
    wait_until(lambda: Node.objects.get(pk=node.pk).status == "online", 30, "the node back online")
    stop_process(agent, sig=signal.SIGKILL)
    last = Node.objects.get(pk=node.pk).last_heartbeat_at
    refresh_node_statuses(now=last + timedelta(seconds=31))
    assert Node.objects.get(pk=node.pk).status == "suspect"
    refresh_node_statuses(now=last + timedelta(seconds=61))
    assert Node.objects.get(pk=node.pk).status == "offline"


def test_a_wrong_key_is_a_configuration_error_logged_once(control_plane, tmp_path):
    agent = start_agent(
        control_plane, tmp_path, HETEROFLOW_AGENT_KEY="not-the-key-" * 3, HETEROFLOW_AGENT_LOG_LEVEL="debug"
    )
    try:
        wait_until(lambda: agent_log(agent).count("heartbeat not accepted") >= 2, 30, "two refused beats")
    finally:
        output = agent_output(agent, timeout=60)
    assert output.count("configuration error") == 1, output
    assert not Node.objects.exists()
