"""The agent's end of the tunnel (heteroflow_agent.tunnel) against a stand-in control plane
in the test: a scripted registration route (agent/tests/server.py) and asyncssh's
`listen_reverse` as the control plane's SSH client. The tasks are real processes run by
the process runtime: two HTTP servers, one per task.

- the agent registers its host key and dials out; the control plane's key is the only
  one it accepts;
- a channel to task A's port reaches A's server; a channel that names task A but a port
  task B listens on, an IP address, or a task the node does not run is refused, with the
  reason (what the control plane audits);
- an exec runs in the task's environment (its GPU visibility variable), with its exit
  status; with a PTY it gets a terminal of the size asked; an exec for a task that does
  not run here is refused with the acknowledgement line the control plane reads;
- a restart of the control plane's listener: the agent dials again."""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import asyncssh
import psutil
import pytest
from agent.tests.tunnel_support import ControlPlane, free_port, http_get, listening, refusal
from agent.tests.waiting import wait_for

from heteroflow_agent import tunnel
from heteroflow_agent.client import ServerClient
from heteroflow_agent.runtime.base import TaskSpec
from heteroflow_agent.runtime.process import ProcessRuntime

SERVE = (
    "import http.server, sys; "
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()"
)


@pytest.fixture
def node(tmp_path, server):
    runtime = ProcessRuntime(tmp_path / "tasks")
    ports = {1: free_port(), 2: free_port()}
    for task_id, port in ports.items():
        runtime.start(
            TaskSpec(
                task_id, "", [sys.executable, "-c", SERVE, str(port)], env={"NVIDIA_VISIBLE_DEVICES": f"{task_id}"}
            )
        )
    for port in ports.values():
        wait_for(lambda port=port: listening(port), 20, f"a task's server on {port}")
    plane = ControlPlane(free_port())
    server.answer(
        "/api/v1/nodes/n1/tunnel",
        *[(200, {"host": "127.0.0.1", "port": plane.port, "client_key": plane.key.export_public_key().decode()}, {})]
        * 5,
    )
    keeper = tunnel.Tunnel("n1", server.url, ServerClient(server.url, "k", attempts=1), tmp_path, runtime)
    stop = threading.Event()
    thread = threading.Thread(target=keeper.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield {"plane": plane, "ports": ports, "keeper": keeper, "server": server, "tmp": tmp_path}
    finally:
        stop.set()
        thread.join(10)
        plane.close()
        for task_id in ports:
            runtime.stop(task_id, grace_seconds=1)


def test_the_agent_registers_dials_out_and_admits_only_its_tasks_own_ports(node):
    plane, ports = node["plane"], node["ports"]
    answer = plane.call(lambda conn: http_get(conn, "task-1", ports[1]))
    assert answer.startswith(b"HTTP/1.0 200")
    registered = node["server"].requests[0]
    assert registered["path"] == "/api/v1/nodes/n1/tunnel" and registered["json"]["host_key"].startswith("ssh-ed25519 ")
    assert (node["tmp"] / tunnel.HOST_KEY_FILE).stat().st_mode & 0o777 == 0o600

    assert plane.call(lambda c: refusal(c, "task-1", ports[2])) == f"task 1 does not listen on port {ports[2]}"
    assert "not a task" in plane.call(lambda c: refusal(c, "127.0.0.1", ports[1]))
    assert plane.call(lambda c: refusal(c, "task-9", ports[1])) == "task 9 does not run on this node"
    assert plane.call(lambda c: http_get(c, "task-2", ports[2])).startswith(b"HTTP/1.0 200")


def test_an_exec_runs_in_the_tasks_environment_with_its_exit_status_and_a_pty(node):
    plane = node["plane"]

    async def run(conn, request, **options):
        process = await conn.create_process(json.dumps(request), encoding=None, **options)
        ack = await process.stderr.readline()
        out = await process.stdout.read()
        done = await process.wait(check=False)
        return ack, out, done.exit_status

    ack, out, status = plane.call(
        lambda c: run(c, {"task": 2, "argv": ["sh", "-c", "echo cards=$NVIDIA_VISIBLE_DEVICES; exit 7"]})
    )
    assert (ack, out, status) == (tunnel.ACK_PREFIX + b"ok\n", b"cards=2\n", 7)

    ack, out, status = plane.call(
        lambda c: run(
            c, {"task": 1, "argv": ["sh", "-c", "tty >/dev/null && stty size"]}, term_type="xterm", term_size=(100, 30)
        )
    )
    assert ack == tunnel.ACK_PREFIX + b"ok\n" and out.strip() == b"30 100" and status == 0

    ack, out, status = plane.call(lambda c: run(c, {"task": 5, "argv": ["true"]}))
    assert ack == tunnel.ACK_PREFIX + b"refused: task 5 does not run on this node\n" and status == 126


def test_an_execs_command_ends_when_its_session_does(node, tmp_path):
    plane, marker = node["plane"], tmp_path / "pid"

    async def leave_early(conn):
        process = await conn.create_process(
            json.dumps({"task": 1, "argv": ["sh", "-c", f"echo $$ > {marker}; exec sleep 60"]}), encoding=None
        )
        await process.stderr.readline()
        await asyncio.sleep(0.5)
        process.close()  # the user goes (or the control plane ends the session)

    plane.call(leave_early)
    pid = int(wait_for(lambda: marker.exists() and marker.read_text().strip(), 10, "the command's pid"))
    wait_for(lambda: ended(pid), 10, "its end")


def ended(pid: int) -> bool:
    """Gone, or a zombie (reaped a moment later); gone between the two looks counts too."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_client_key_other_than_the_control_planes_is_refused(node):
    plane = node["plane"]
    plane.call(lambda c: asyncio.sleep(0))  # the real one is connected
    stranger = tunnel.TunnelServer(plane.key, tunnel.Admission(lambda _: None))
    assert stranger.validate_public_key(tunnel.USERNAME, plane.key)
    assert not stranger.validate_public_key(tunnel.USERNAME, asyncssh.generate_private_key("ssh-ed25519"))
    assert not stranger.validate_public_key("root", plane.key)


def test_the_agent_dials_again_when_the_control_plane_comes_back(node):
    plane, ports = node["plane"], node["ports"]
    plane.call(lambda c: asyncio.sleep(0))
    plane.stop_listening()
    wait_for(lambda: not node["keeper"].connected.is_set(), 10, "the agent to see the connection gone")
    plane.listen()
    assert plane.call(lambda c: http_get(c, "task-1", ports[1]), timeout=15).startswith(b"HTTP/1.0 200")
