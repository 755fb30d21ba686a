"""`make up` for real: the launcher on a fresh data folder with the embedded PostgreSQL and
Redis, the web server, a Celery worker and beat; then a clean stop and a second start
that finds its data again."""

import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import requests

from tests.headers import bearer_http
from tests.live import wait_until

REPO = Path(__file__).resolve().parents[1]
ADMIN_KEY = "sk-admin-" + "e2e" * 12
pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(data_dir: Path, port: int) -> tuple[subprocess.Popen, list[str]]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL") and not k.startswith("HETEROFLOW_")
    }
    env.update(
        HETEROFLOW_DATA_DIR=str(data_dir),
        HETEROFLOW_PORT=str(port),
        HETEROFLOW_ADMIN_API_KEY=ADMIN_KEY,
        # the agent installer's downloads, kept between runs on this machine
        HETEROFLOW_AGENT_DIST_DIR=str(Path(tempfile.gettempdir()) / "heteroflow-e2e-agent-dist"),
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "heteroflow.launcher", "up"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, deadline = [], time.monotonic() + 180
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Press Ctrl-C to stop" in line:
            return process, lines
    process.kill()
    pytest.fail("the launcher did not come up:\n" + "".join(lines))


def stop(process: subprocess.Popen) -> list[str]:
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 0, rest
    return rest.splitlines()


def test_make_up_brings_the_system_up_and_stops_it_cleanly(tmp_path):
    data_dir, port = tmp_path / "hf", free_port()
    base = f"http://127.0.0.1:{port}"
    process, output = start(data_dir, port)
    try:
        text = "".join(output)
        for url in ("/portal/", "/admin/", "/api/docs/", "/api/schema/"):
            assert f"{base}{url}" in text
        assert "PostgreSQL, Redis embedded" in text
        password_line = next(line for line in output if "with password:" in line)
        password = password_line.rsplit(":", 1)[1].strip()
        credentials = data_dir / "admin-credentials"
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
        assert f"password={password}" in credentials.read_text()

        assert requests.get(f"{base}/health", timeout=10).json() == {"status": "degraded"}
        # the admin signs in on the portal's page (its providers' buttons beside the form)
        admin_login = requests.get(f"{base}/admin/login/", timeout=10)
        assert admin_login.url.startswith(f"{base}/portal/login/?next=%2Fadmin%2F")
        assert 'name="password"' in admin_login.text
        assert requests.get(f"{base}/api/docs/", timeout=10).status_code == 200
        assert requests.get(f"{base}/api/schema/", timeout=10).status_code == 200
        portal = requests.get(f"{base}/portal/", timeout=10, allow_redirects=False)
        assert portal.status_code == 302 and portal.headers["Location"].startswith("/portal/login/")

        session = requests.Session()
        login_page = session.get(f"{base}/admin/login/", timeout=10)
        token = login_page.cookies["csrftoken"]
        signed_in = session.post(
            f"{base}/admin/login/?next=/admin/",
            data={"username": "admin", "password": password, "csrfmiddlewaretoken": token},
            headers={"Referer": f"{base}/admin/login/"},
            timeout=10,
        )
        assert "Site administration" in signed_in.text

        # a job goes through the real broker to the real worker and lands in the database
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")}
        env.update(
            DATABASE_URL=f"postgresql://postgres@{quote(str(data_dir / 'postgres'), safe='')}/heteroflow",
            REDIS_URL=f"unix://{data_dir / 'redis' / 'redis.sock'}",
            HETEROFLOW_DATA_DIR=str(data_dir),
        )
        probe = (
            "import time; from apps.core.jobs import purge_expired_sessions_job as job; "
            "from apps.core.models import JobRun; job.delay(); deadline = time.monotonic() + 60\n"
            "while time.monotonic() < deadline and "
            "not JobRun.objects.filter(key='core.purge_expired_sessions', runs__gte=1).exists():\n"
            "    time.sleep(0.2)\n"
            "print('RUNS', "
            "JobRun.objects.filter(key='core.purge_expired_sessions').values_list('runs', flat=True).first())"
        )
        result = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c", probe],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "RUNS 1" in result.stdout, result.stdout + result.stderr
        # each worker samples its own host as it starts; each process group keeps its
        # metrics in a folder of its own
        sampled = (
            "import time, socket; from apps.monitoring.models import ServerMetric; "
            "deadline = time.monotonic() + 60\n"
            "while time.monotonic() < deadline and "
            "not ServerMetric.objects.filter(host=socket.gethostname()).exists():\n"
            "    time.sleep(0.2)\n"
            "print('SAMPLES', ServerMetric.objects.filter(host=socket.gethostname()).count())"
        )
        result = subprocess.run(
            [sys.executable, "manage.py", "shell", "-c", sampled],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "SAMPLES 0" not in result.stdout and "SAMPLES" in result.stdout, result.stdout + result.stderr
        assert list((data_dir / "metrics" / "worker").glob("*.db")) and list(
            (data_dir / "metrics" / "web").glob("*.db")
        )
        scraped = requests.get(f"{base}/metrics", timeout=10)
        assert scraped.status_code == 200 and "heteroflow_scheduler_running" in scraped.text

        headers = bearer_http(ADMIN_KEY)
        # the local agent registered this machine as a node, under the id it keeps
        kept = data_dir / "agent" / "node-id"
        node_id = wait_until(lambda: kept.exists() and kept.read_text().strip(), 60, "the local agent's node id")
        nodes = wait_until(
            lambda: requests.get(f"{base}/api/v1/nodes", headers=headers, timeout=10).json()["results"],
            60,
            "the local agent's node",
        )
        assert [n["id"] for n in nodes] == [node_id] and nodes[0]["gpus"]
        # and the installer serves the agent to other machines
        assert requests.get(f"{base}/api/v1/agent/install.sh", timeout=10).text.startswith("#!")

        created = requests.post(
            f"{base}/api/v1/tenants", json={"name": "Lab", "slug": "lab"}, headers=headers, timeout=30
        )
        assert created.status_code == 201, created.text
    finally:
        stop(process)
    assert not (data_dir / "postgres" / "postmaster.pid").exists(), "the embedded PostgreSQL was left running"

    again, output = start(data_dir, port)
    try:
        text = "".join(output)
        assert "with password:" not in text  # shown once, never again
        tenants = requests.get(f"{base}/api/v1/tenants", headers=bearer_http(ADMIN_KEY), timeout=10)
        assert [t["slug"] for t in tenants.json()["results"]] == ["lab"]
        # the same machine comes back as the same node
        nodes = requests.get(f"{base}/api/v1/nodes", headers=bearer_http(ADMIN_KEY), timeout=10).json()
        assert [n["id"] for n in nodes["results"]] == [node_id]
    finally:
        stop(again)
