"""Whom the process runtime runs its tasks as (docs/agent.md#the-process-runtimes-user):
the operator's unprivileged user, switched to by the supervisor before the command
starts; never root unless the operator says so, and a refusal the node reports rather
than tasks it never starts. The switch itself is run for real (as `nobody`) where the
test runs as root."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from agent.tests.waiting import wait_for

from heteroflow_agent.client import ServerClient
from heteroflow_agent.collect import EngineState
from heteroflow_agent.config import AgentConfig, ConfigError, load
from heteroflow_agent.heartbeat import Heartbeat
from heteroflow_agent.main import choose_runtime
from heteroflow_agent.runtime.base import TaskSpec
from heteroflow_agent.runtime.process import ROOT_REFUSED, ProcessRuntime, ProcessUserRefused, TaskUser, task_user

ENV = {"HETEROFLOW_SERVER_URL": "http://h:1", "HETEROFLOW_AGENT_KEY": "k", "HETEROFLOW_NODE_ID": "n1"}


def someone_else() -> pwd.struct_passwd:
    """A user of this host that is not root (nobody, where it exists)."""
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        others = [entry for entry in pwd.getpwall() if entry.pw_uid != 0]
        if not others:
            pytest.skip("this host lists no user but root")
        return others[0]


# --- the policy ---------------------------------------------------------------------------


def test_an_agent_running_as_root_refuses_to_run_tasks_as_root_unless_allowed():
    with pytest.raises(ProcessUserRefused) as refused:
        task_user("", euid=0)
    assert str(refused.value) == ROOT_REFUSED
    assert "HETEROFLOW_PROCESS_USER" in ROOT_REFUSED and "HETEROFLOW_PROCESS_RUN_AS_ROOT=true" in ROOT_REFUSED
    assert task_user("", allow_root=True, euid=0) is None  # the operator's explicit leave
    with pytest.raises(ProcessUserRefused, match=r"process_user 'root' is root \(uid 0\)"):
        task_user("root", euid=0)
    with pytest.raises(ProcessUserRefused, match=r"process_user '0' is root"):
        task_user("0", euid=0)
    assert task_user("root", allow_root=True, euid=0) is None


def test_an_unprivileged_agent_runs_tasks_as_itself_and_cannot_switch():
    other = someone_else()
    assert task_user("", euid=4242) is None  # as today: the agent's own user
    assert task_user(other.pw_name, euid=other.pw_uid) is None  # the agent's own user, named
    with pytest.raises(ProcessUserRefused, match="only an agent running as root can run tasks as another user"):
        task_user(other.pw_name, euid=other.pw_uid + 1)


def test_a_named_user_is_resolved_by_name_or_uid_with_its_groups():
    other = someone_else()
    by_name = task_user(other.pw_name, euid=0)
    assert by_name == task_user(str(other.pw_uid), euid=0)
    assert (by_name.name, by_name.uid, by_name.gid) == (other.pw_name, other.pw_uid, other.pw_gid)
    assert by_name.home == (other.pw_dir or "/") and other.pw_gid in by_name.groups
    with pytest.raises(ProcessUserRefused, match="process_user 'no-such-user-hf': no such user on this host"):
        task_user("no-such-user-hf", euid=0)
    with pytest.raises(ProcessUserRefused, match="no such user"):
        task_user("4294967294", euid=0)


def test_the_configuration_reads_the_user_and_the_leave_for_root(tmp_path):
    cfg = load("-", ENV | {"HETEROFLOW_AGENT_DATA_DIR": str(tmp_path)})
    assert (cfg.process_user, cfg.process_run_as_root) == ("", False)
    cfg = load(
        "-",
        ENV
        | {
            "HETEROFLOW_AGENT_DATA_DIR": str(tmp_path),
            "HETEROFLOW_PROCESS_USER": "heteroflow-task",
            "HETEROFLOW_PROCESS_RUN_AS_ROOT": "yes",
        },
    )
    assert (cfg.process_user, cfg.process_run_as_root) == ("heteroflow-task", True)
    with pytest.raises(ConfigError) as bad:
        load(
            "-",
            ENV
            | {
                "HETEROFLOW_AGENT_DATA_DIR": str(tmp_path),
                "HETEROFLOW_PROCESS_USER": "bad user;rm",
                "HETEROFLOW_PROCESS_RUN_AS_ROOT": "perhaps",
            },
        )
    assert bad.value.problems == [
        "process_user 'bad user;rm' must be a user name or a numeric uid",
        "process_run_as_root 'perhaps' is not true or false",
    ]


# --- the node says so ---------------------------------------------------------------------


class NoEngine:
    def state(self):
        return EngineState(False, "no container engine: socket missing")

    def image_tags(self):
        return []


def no_gpus() -> SimpleNamespace:
    """A detection that found no card."""
    return SimpleNamespace(
        gpus=[], collect_failures=[], collector_error="", capabilities={}, labels={}, is_container=False, health=None
    )


def config(tmp_path, **values) -> AgentConfig:
    return AgentConfig(
        server_url="http://unused",
        api_key="k",
        node_id="n1",
        data_dir=Path(tmp_path),
        model_scan_dirs=(str(tmp_path),),
        allow_process_runtime=True,
        **values,
    )


def beat_of(cfg: AgentConfig, refusal: str) -> dict:
    client = ServerClient(cfg.server_url, "k", attempts=1, sleep=lambda s: None)
    return Heartbeat(cfg, client, detect_gpus=no_gpus, engine=NoEngine(), process_refusal=refusal).payload()


def test_a_refused_process_runtime_makes_the_node_say_why_and_take_no_tasks(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    cfg = config(tmp_path)
    runtime, refusal = choose_runtime(cfg, NoEngine())
    assert runtime is None and refusal == ROOT_REFUSED
    body = beat_of(cfg, refusal)
    assert (body["exec_mode"], body["executable"], body["error_message"]) == ("none", False, ROOT_REFUSED)


def test_with_a_user_or_the_leave_the_process_runtime_runs_tasks(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    other = someone_else()
    runtime, refusal = choose_runtime(config(tmp_path, process_user=other.pw_name), NoEngine())
    assert refusal == "" and runtime.kind == "process" and runtime.user.uid == other.pw_uid
    runtime, refusal = choose_runtime(config(tmp_path, process_run_as_root=True), NoEngine())
    assert refusal == "" and runtime.user is None
    body = beat_of(config(tmp_path, process_run_as_root=True), refusal)
    assert (body["exec_mode"], body["executable"], body["error_message"]) == ("process", True, "")


# --- the switch, for real -----------------------------------------------------------------

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="switching a task to another user needs the test to run as root (it does not)"
)


@pytest.fixture
def passable_dir():
    """A data directory every user may pass through (pytest's own tmp_path is under a
    0700 directory of root's: a task of another user could not resolve a path in it)."""
    path = Path(tempfile.mkdtemp(prefix="hf-process-user-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_a_task_runs_as_the_operators_user_in_a_working_directory_of_its_own(passable_dir):
    other = someone_else()
    user = task_user(other.pw_name)
    assert isinstance(user, TaskUser)
    state_dir = passable_dir / "state"
    runtime = ProcessRuntime(state_dir, user=user)
    assert runtime.reach_problem() == ""
    # the host's own sh and id: the test's interpreter may live where nobody may enter
    script = (
        'touch made-here; echo "uid=$(id -u) euid=$(id -u) gid=$(id -g) groups=$(id -G | tr " " ,)";'
        ' echo "home=$HOME user=$USER cwd=$(pwd -P)";'
        " if test -r ../task.json; then echo records=readable; else echo records=closed; fi;"
        ' if test -e "$(pwd -P)/made-here"; then echo absolute=yes; else echo absolute=no; fi'
    )
    runtime.start(TaskSpec(task_id=71, image="", command=["sh", "-c", script]))
    state = wait_for(lambda: (lambda s: s if s is not None and not s.running else None)(runtime.state(71)))
    assert state.exit_code == 0, runtime.logs_tail(71)
    seen = dict(pair.split("=", 1) for pair in runtime.logs_tail(71).split())
    assert (seen["uid"], seen["euid"], seen["gid"]) == (str(other.pw_uid), str(other.pw_uid), str(other.pw_gid))
    assert sorted(int(g) for g in seen["groups"].split(",")) == sorted(user.groups)  # root's groups are gone
    assert (seen["home"], seen["user"]) == (user.home, other.pw_name)
    task_dir = state_dir / "task-71"
    assert seen["cwd"] == str((task_dir / "work").resolve()) and seen["absolute"] == "yes"
    # its working directory is its own; the records and the log stay the agent's
    assert (task_dir / "work").stat().st_uid == other.pw_uid
    assert (task_dir / "work" / "made-here").stat().st_uid == other.pw_uid
    assert seen["records"] == "closed"
    for name in ("task.json", "command.json", "exit.json", "output.log"):
        assert (task_dir / name).stat().st_uid == 0 and (task_dir / name).stat().st_mode & 0o077 == 0, name
    assert json.loads((task_dir / "task.json").read_text())["user"] == {"name": other.pw_name, "uid": other.pw_uid}
    runtime.remove(71)
    assert not task_dir.exists()


@needs_root
def test_a_data_directory_the_task_user_cannot_pass_is_named(passable_dir):
    other = someone_else()
    closed = passable_dir / "closed"
    closed.mkdir(mode=0o700)
    runtime = ProcessRuntime(closed / "state", user=task_user(other.pw_name))
    assert runtime.reach_problem() == (
        f"{other.pw_name} cannot pass {closed} (mode 0700): its tasks will reach their working directory "
        "only by relative paths; let others pass (chmod o+x) the directories above the agent's data directory"
    )
    assert ProcessRuntime(closed / "state").reach_problem() == ""  # as the agent's own user: nothing to pass


@needs_root
def test_a_task_of_the_operators_user_is_stopped_by_the_agent(tmp_path):
    other = someone_else()
    runtime = ProcessRuntime(tmp_path / "state", user=task_user(other.pw_name))
    runtime.start(TaskSpec(task_id=72, image="", command=["sh", "-c", "echo up; exec sleep 300"]))
    wait_for(lambda: "up" in runtime.logs_tail(72))
    command = json.loads((tmp_path / "state" / "task-72" / "command.json").read_text())
    assert os.stat(f"/proc/{command['pid']}").st_uid == other.pw_uid
    runtime.stop(72, grace_seconds=5)
    state = wait_for(lambda: (lambda s: s if s is not None and not s.running else None)(runtime.state(72)))
    assert state.exit_code == 143  # SIGTERM, forwarded to a process of another user
    assert not Path(f"/proc/{command['pid']}").exists() or "Z" in Path(f"/proc/{command['pid']}/stat").read_text()
