"""The tunnel into container tasks (heteroflow_agent.tunnel with the docker runtime), on
the real test engine (scripts/container-engine.sh; skipped without one, as the other
docker tests are). The runtime starts containers on the host's network, so a container
task is reached at 127.0.0.1 on the ports its own processes listen on, and an exec runs
inside the container (`docker exec`), in its environment, with the command's status."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from agent.tests.tunnel_support import ControlPlane, free_port, http_get, listening, refusal
from agent.tests.waiting import wait_for

from heteroflow_agent import tunnel
from heteroflow_agent.client import ServerClient
from heteroflow_agent.runtime.base import TaskSpec
from heteroflow_agent.runtime.docker import DockerRuntime


@pytest.fixture
def container_node(docker_engine, docker_task_ids, docker_test_image, docker_test_labels, server, tmp_path):
    runtime = DockerRuntime(timeout=30)
    ports = {}
    ids = []
    for _ in range(2):
        task_id, port = docker_task_ids(), free_port()
        runtime.start(
            TaskSpec(
                task_id=task_id,
                image=docker_test_image,
                command=["httpd", "-f", "-p", f"127.0.0.1:{port}", "-h", "/"],
                env={"NVIDIA_VISIBLE_DEVICES": "3"},
                labels=docker_test_labels,
            )
        )
        ports[task_id] = port
        ids.append(task_id)
    for port in ports.values():
        wait_for(lambda port=port: listening(port), 30, f"a container's server on {port}")
    plane = ControlPlane(free_port())
    server.answer(
        "/api/v1/nodes/n1/tunnel",
        *[(200, {"host": "127.0.0.1", "port": plane.port, "client_key": plane.key.export_public_key().decode()}, {})]
        * 5,
    )
    keeper = tunnel.Tunnel(
        "n1",
        server.url,
        ServerClient(server.url, "k", attempts=1),
        tmp_path,
        runtime,
        docker_exec=tunnel.docker_exec_with(runtime.engine_client),
    )
    stop = threading.Event()
    thread = threading.Thread(target=keeper.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield {"plane": plane, "ports": ports, "ids": ids}
    finally:
        stop.set()
        thread.join(10)
        plane.close()


def test_a_container_task_is_reached_on_its_own_ports_and_execs_run_inside_it(container_node):
    plane, ports, (first, second) = container_node["plane"], container_node["ports"], container_node["ids"]
    assert plane.call(lambda c: http_get(c, f"task-{first}", ports[first])).startswith(b"HTTP/1.")
    refused = plane.call(lambda c: refusal(c, f"task-{first}", ports[second]))
    assert refused == f"task {first} does not listen on port {ports[second]}"

    async def run(conn, argv, stdin=b"from stdin\n", **options):
        process = await conn.create_process(json.dumps({"task": first, "argv": argv}), encoding=None, **options)
        ack = await process.stderr.readline()
        if stdin is not None:
            process.stdin.write(stdin)
            process.stdin.write_eof()
        out = await process.stdout.read()
        err = await process.stderr.read()
        return ack, out, err, (await process.wait(check=False)).exit_status

    ack, out, err, status = plane.call(
        lambda c: run(c, ["sh", "-c", "cat; echo cards=$NVIDIA_VISIBLE_DEVICES; echo oops >&2; exit 4"])
    )
    assert ack == tunnel.ACK_PREFIX + b"ok\n"
    assert (out, err, status) == (b"from stdin\ncards=3\n", b"oops\n", 4)

    ack, out, err, status = plane.call(
        lambda c: run(c, ["sh", "-c", "tty; echo $TERM"], stdin=None, term_type="xterm", term_size=(90, 20))
    )
    # a terminal of its own (busybox's stty cannot read the size under this engine's PTY)
    assert out.startswith(b"/dev/pts/") and out.endswith(b"\r\nxterm\r\n") and status == 0


def test_a_container_that_does_not_run_is_not_reached(container_node, docker_engine):
    plane, ports, (first, _) = container_node["plane"], container_node["ports"], container_node["ids"]
    docker_engine.containers.get(f"task-{first}").kill()
    wait_for(lambda: not listening(ports[first]), 20, "the container's end")
    assert plane.call(lambda c: refusal(c, f"task-{first}", ports[first])) == f"task {first} does not run on this node"


def test_an_execs_command_in_a_container_ends_when_its_session_does(container_node, docker_engine):
    plane, (first, _) = container_node["plane"], container_node["ids"]

    async def leave_early(conn):
        process = await conn.create_process(json.dumps({"task": first, "argv": ["sleep", "61"]}), encoding=None)
        await process.stderr.readline()
        await asyncio.sleep(0.5)
        process.close()

    def sleeping() -> bool:
        listing = docker_engine.containers.get(f"task-{first}").exec_run(["ps"]).output
        return b"sleep 61" in listing

    plane.call(leave_early)
    wait_for(lambda: not sleeping(), 15, "the exec's command to end")
