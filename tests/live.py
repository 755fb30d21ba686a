"""Live processes for end-to-end tests: the control plane under uvicorn on the test
database, and real agent processes pointed at it. Modules using these need
`django_db(transaction=True)`: the server processes see only committed rows."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import requests
from django.conf import settings
from django.db import connection

from heteroflow.launcher import web_command

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nothing listens on (bound, then let go): free for a server to take, closed
    for a client to knock on."""
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


def server_env(**extra) -> dict:
    """The environment of a server process working on this test run's database."""
    test_database = urlunsplit(
        urlsplit(os.environ["DATABASE_URL"])._replace(path="/" + connection.settings_dict["NAME"])
    )
    return os.environ | {"DATABASE_URL": test_database, "HETEROFLOW_ENV": "test"} | host_ports() | extra


def host_ports() -> dict:
    """A block of host ports per test worker: every simulated node of every test cluster
    is this one machine, so two workers' clusters handing out the same port (a replica's,
    a group master's) would meet on it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = 20_000 + 1_000 * (int(worker) if worker.isdigit() else 0)
    return {"HETEROFLOW_HOST_PORT_FIRST": str(first), "HETEROFLOW_HOST_PORT_LAST": str(first + 999)}


def start_control_plane(
    port: int | None = None, *, env: dict | None = None, args: tuple = ()
) -> tuple[subprocess.Popen, str]:
    """uvicorn serving heteroflow.asgi on this test run's database (on `port`, to bring
    a stopped one back where its agents look for it; `env` and `args` add to its
    environment and command line)."""
    port = port or free_port()
    server = subprocess.Popen(
        web_command("127.0.0.1", port, "--log-level", "warning", *args),
        cwd=REPO,
        env=server_env(**(env or {})),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for_web(url)
    return server, url


def wait_for_web(url: str, timeout: float = 60) -> None:
    """Until the control plane at `url` answers its health probe (503 included: it is up)."""

    def up():
        try:
            return requests.get(f"{url}/health", timeout=1).status_code in (200, 503)
        except requests.RequestException:
            return False

    wait_until(up, timeout, f"the control plane at {url}")


def stop_process(process: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 30) -> None:
    if process.poll() is None:
        os.killpg(process.pid, sig)
        process.wait(timeout=timeout)


def start_agent(url: str, data_dir: Path, *, container_engine: bool = False, **extra) -> subprocess.Popen:
    """An agent process. Without `container_engine` it never sees DOCKER_HOST, so it runs
    tasks with the process runtime even where the test engine is up."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")}
    if not container_engine:
        inherited.pop("DOCKER_HOST", None)
    env = inherited | {
        "HETEROFLOW_SERVER_URL": url,
        "HETEROFLOW_AGENT_KEY": settings.HETEROFLOW_AGENT_SECRET,
        "HETEROFLOW_AGENT_DATA_DIR": str(data_dir),
        "HETEROFLOW_HEARTBEAT_INTERVAL": "5",
        "HETEROFLOW_MODEL_SCAN_DIRS": str(data_dir / "models"),
        # no container engine on the test machines unless DOCKER_HOST says so: the
        # operator allows plain processes
        "HETEROFLOW_ALLOW_PROCESS_RUNTIME": "true",
        # the test machines run as root, and the tests' tasks are the tests' own
        "HETEROFLOW_PROCESS_RUN_AS_ROOT": "true",
        **extra,
    }
    # its output goes to a file, so a test can wait for a line while it runs
    log_path = data_dir.with_name(f"{data_dir.name}-agent-{time.monotonic_ns()}.log")
    with open(log_path, "w") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "heteroflow_agent"],
            cwd=REPO,
            env=env,
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    agent.log_path = log_path
    return agent


def agent_log(agent: subprocess.Popen) -> str:
    return agent.log_path.read_text(errors="replace")


def agent_output(agent: subprocess.Popen, timeout: float = 30) -> str:
    stop_process(agent, timeout=timeout)
    return agent_log(agent)
