"""`hf` end to end: the package installed from client/ into a fresh virtual environment
(no download: its dependencies are the project's virtual environment's, seen through a
.pth file), the real `hf` run as a subprocess against a live control plane (uvicorn on
the test database) and a real agent running tasks with the process runtime
(tests/live.py). The scheduler's cycles are run by the test, as in tests/tasks."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from apps.core.principals import Principal, PrincipalKind
from apps.nodes.models import Node
from apps.scheduler.services import run_cycle, set_plugin_options
from apps.tasks import logs
from apps.tasks.models import Task
from apps.tenants import services as tenants
from apps.tenants.choices import Role
from tests.factories import UserFactory
from tests.live import free_port, start_agent, start_control_plane, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

CLIENT = Path(__file__).resolve().parents[1]


def build_isolation() -> list[str]:
    """Build with this environment's setuptools where it can make wheels by itself (70.1+,
    or with `wheel`); else pip brings the build requirements, as `make install` does."""
    import setuptools

    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    return ["--no-build-isolation"] if (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") else []


@pytest.fixture(scope="module")
def hf_bin(tmp_path_factory) -> Path:
    """`hf` from `pip install ./client` into a new virtual environment."""
    venv = tmp_path_factory.mktemp("hf-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # the dependencies (click, httpx, rich, PyYAML, jsonschema) without a download
    (purelib / "_project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            *("-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet"),
            *("--no-deps", "--ignore-installed", *build_isolation(), str(CLIENT)),
        ],
        check=True,
    )
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import heteroflow_client; print(heteroflow_client.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(purelib)), where  # the installed copy, not the tree's
    return venv / "bin" / "hf"


@pytest.fixture
def cluster(tmp_path):
    server, url = start_control_plane()
    agent = start_agent(url, tmp_path / "agent", HETEROFLOW_RECONCILE_SECONDS="5")
    try:
        wait_until(lambda: Node.objects.filter(status="online").exists(), 40, "the node to come online")
        yield {"url": url, "key": lab_member_key()}
    finally:
        stop_process(agent)
        stop_process(server)


def lab_member_key() -> str:
    """A tenant `lab` with a member, alice, and her key; the scheduler told to ignore the
    test machine's own CPU and memory load."""
    tenant = tenants.create_tenant(name="Lab", slug="lab")
    set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})
    alice = UserFactory(username="alice")
    tenants.add_member(tenant, username=alice.username, role=Role.MEMBER)
    owner = Principal(PrincipalKind.TENANT_USER, user=alice, tenant=tenant, role=Role.MEMBER)
    return tenants.issue_tenant_key(principal=owner, tenant=tenant, owner=alice, name="laptop").key


def hf_env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HETEROFLOW_", "XDG_"))}
    return env | {
        "HOME": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / "cfg"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }


def placed(task_id: int) -> None:
    wait_until(lambda: task_id in run_cycle().bound, 30, f"task {task_id} to be placed")


def ended(task_id: int, timeout: float = 60) -> Task:
    return wait_until(
        lambda: (task := Task.objects.get(pk=task_id)).status in ("completed", "failed", "stopped") and task,
        timeout,
        f"task {task_id} to end",
    )


def test_hf_logs_in_runs_lists_shows_and_refuses_a_broken_file(hf_bin, cluster, tmp_path):
    env = hf_env(tmp_path)

    def hf(*args, input=None, timeout=60):
        result = subprocess.run(
            [str(hf_bin), *args], env=env, input=input, capture_output=True, text=True, timeout=timeout
        )
        return result.returncode, result.stdout, result.stderr

    code, out, err = hf("login", "--url", cluster["url"], input="sk-tenant-not-a-key\n")
    assert code == 2 and "hf login" in err
    code, out, err = hf("login", "--url", cluster["url"], input=cluster["key"] + "\n")
    assert code == 0, err
    assert "alice" in out and "lab" in out
    config = tmp_path / "cfg" / "heteroflow" / "config.toml"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and cluster["key"] in config.read_text()

    code, out, err = hf(
        "run",
        "--name",
        "hello",
        "--image",
        "busybox",
        "--gpus",
        "0",
        "--max-duration",
        "600",
        "--",
        "sh",
        "-c",
        "echo hello from hf",
    )
    assert code == 0, err
    task_id = int(out.strip())
    code, out, err = hf("ps", "-o", "json")
    assert code == 0 and [t["id"] for t in json.loads(out)] == [task_id]  # pending: active
    placed(task_id)
    task = ended(task_id)
    assert (task.status, task.exit_code) == ("completed", 0), task.error_message

    code, out, err = hf("ps")
    assert code == 0 and str(task_id) not in out  # finished: not among the active ones
    code, out, err = hf("ps", "--all", "-o", "json")
    assert code == 0 and {(t["id"], t["status"]) for t in json.loads(out)} == {(task_id, "completed")}
    code, out, err = hf("ps", "--all")
    assert code == 0 and "hello" in out and "completed" in out
    code, out, err = hf("show", str(task_id), "-o", "json")
    shown = json.loads(out)
    assert code == 0 and (shown["exit_code"], shown["name"], shown["max_duration_seconds"]) == (0, "hello", 600)
    code, out, err = hf("show", str(task_id))
    assert code == 0 and "completed" in out and "echo hello from hf" in out
    code, out, err = hf("logs", str(task_id))
    assert code == 0 and "hello from hf" in out

    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "kind: task\nname: fine\nimage: busybox\ngpu_required: 0\ncommand: [true]\n---\nkind: task\nname: [oops\n"
    )
    before = Task.objects.count()
    code, out, err = hf("apply", "-f", str(broken))
    assert code == 1
    assert f"{broken}:9:1: expected ',' or ']'" in err and "started at line 8, column 7" in err
    assert "nothing was submitted" in err and "Traceback" not in err
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("kind: task\nname: fine\nimage: busybox\ngpus: 2\n")
    code, out, err = hf("apply", "-f", str(unknown))
    assert code == 1 and f"{unknown}:4:1: gpus: unknown field" in err
    assert Task.objects.count() == before  # neither file submitted anything

    code, out, err = hf("show", "999999")
    assert code == 1 and "Not found." in err


def test_hf_run_follow_streams_the_log_and_exits_with_the_tasks_code(hf_bin, cluster, tmp_path):
    env = hf_env(tmp_path) | {"HETEROFLOW_URL": cluster["url"], "HETEROFLOW_API_KEY": cluster["key"]}
    follower = subprocess.Popen(
        [str(hf_bin), "run", "--image", "busybox", "--gpus", "0", "--follow", "--"]
        + ["sh", "-c", "echo first; sleep 1; echo second; exit 3"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        task = wait_until(lambda: Task.objects.filter(tenant__slug="lab").first(), 30, "the task to be queued")
        placed(task.pk)
        ended(task.pk)
        out, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 3, err
    assert out.splitlines()[-2:] == ["first", "second"]


def test_hf_group_run_follow_prefixes_each_line_with_its_rank(hf_bin, cluster, tmp_path):
    env = hf_env(tmp_path) | {"HETEROFLOW_URL": cluster["url"], "HETEROFLOW_API_KEY": cluster["key"]}
    train = tmp_path / "train.yaml"
    train.write_text(
        "kind: group\nname: ddp\nworld_size: 2\ngpus_per_worker: 1\ngpu_type: virtual\nimage: busybox\n"
        "command: [sh, -c, 'echo hello from rank $RANK; echo done']\n"
    )
    # a second node: an agent reports one virtual card, a rank takes one
    second = start_agent(cluster["url"], tmp_path / "agent-2", HETEROFLOW_RECONCILE_SECONDS="5")
    wait_until(lambda: Node.objects.filter(status="online").count() >= 2, 40, "the second node to come online")
    follower = subprocess.Popen(
        [str(hf_bin), "group", "run", "-f", str(train), "--follow"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while follower.poll() is None and time.monotonic() < deadline:
            run_cycle()  # the group's placement (the test runs the scheduler)
            time.sleep(1)
        out, err = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
        stop_process(second)
    assert follower.returncode == 0, err
    lines = out.splitlines()
    for rank in (0, 1):  # each rank's lines, in its order, interleaved with the other's
        assert [line for line in lines if line.startswith(f"[rank {rank}]")] == [
            f"[rank {rank}] hello from rank {rank}",
            f"[rank {rank}] done",
        ]
    assert len(lines) == 4


def test_hf_logs_follow_survives_the_control_plane_away_for_30_s_with_no_line_lost_or_repeated(hf_bin, tmp_path):
    """The control plane is killed while `hf logs -f` follows a task that prints a numbered
    line every 0.1 s, and is back 30 s later on the same port: meanwhile the agent keeps
    the lines it could not send (its spool) and the follower keeps asking; after, every
    line arrives, once, in order."""
    port = free_port()
    server, url = start_control_plane(port)
    agent = start_agent(url, tmp_path / "agent", HETEROFLOW_RECONCILE_SECONDS="5")
    follower = None
    try:
        wait_until(lambda: Node.objects.filter(status="online").exists(), 40, "the node to come online")
        key = lab_member_key()
        env = hf_env(tmp_path) | {"HETEROFLOW_URL": url, "HETEROFLOW_API_KEY": key}
        ticker = "i=0; while [ $i -lt 450 ]; do echo tick $i; i=$((i+1)); sleep 0.1; done"
        run = subprocess.run(
            [str(hf_bin), "run", "--image", "busybox", "--gpus", "0", "-o", "json", "--", "sh", "-c", ticker],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        task_id = Task.objects.get(tenant__slug="lab").pk
        placed(task_id)
        follower = subprocess.Popen(
            [str(hf_bin), "logs", str(task_id), "-f"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: len(logs.read_page(task_id, tail=1)) == 1, 30, "the first lines to be stored")
        stop_process(server)  # the control plane is away...
        time.sleep(30)
        server, _ = start_control_plane(port)  # ...and back where the agent and hf look for it
        ended(task_id, timeout=120)
        out, err = follower.communicate(timeout=90)
        assert follower.returncode == 0, err
        assert out.splitlines() == [f"tick {i}" for i in range(450)]
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
        stop_process(agent)
        stop_process(server)
