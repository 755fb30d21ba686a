"""The process runtime, with real processes: each task runs under a detached supervisor
whose record outlives the agent that started it."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agent.tests.waiting import wait_for

from heteroflow_agent.runtime import supervise
from heteroflow_agent.runtime.base import RuntimeError_, TaskSpec, Volume
from heteroflow_agent.runtime.process import ProcessRuntime

AGENT_DIR = Path(__file__).resolve().parents[2]  # holds the heteroflow_agent package
PY = sys.executable
DEADLINE = 20.0  # generous: a loaded 2-core machine


def spec(task_id: int, command: list[str], **kwargs) -> TaskSpec:
    return TaskSpec(task_id=task_id, image="ignored:latest", command=command, **kwargs)


def finished(runtime: ProcessRuntime, task_id: int):
    return wait_for(
        lambda: (lambda s: s if s is not None and not s.running else None)(runtime.state(task_id)),
        what=f"task {task_id} to finish",
    )


def log_line(runtime: ProcessRuntime, task_id: int, prefix: str) -> str:
    def find():
        for line in runtime.logs_tail(task_id).splitlines():
            if line.startswith(prefix):
                return line
        return None

    return wait_for(find, what=f"{prefix!r} in the log of task {task_id}")


def alive(pid: int, ticks: int | None = None) -> bool:
    stat = supervise.proc_stat(pid)
    return supervise.is_alive(stat) and (ticks is None or stat[3] == ticks)


def read(state_dir: Path, task_id: int, name: str) -> dict:
    return json.loads((state_dir / f"task-{task_id}" / name).read_text())


def processes_mentioning(text: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and alive(int(name)):
            found.append(int(name))
    return found


@pytest.fixture
def state_dir(tmp_path):
    return tmp_path / "state"


@pytest.fixture
def runtime(state_dir):
    rt = ProcessRuntime(state_dir)
    yield rt
    for task_id, state in ProcessRuntime(state_dir).tasks().items():
        if state.running:
            rt.stop(task_id, grace_seconds=0)


# --- basics -----------------------------------------------------------------------------


def test_interface_bits(runtime):
    assert runtime.kind == "process"
    assert runtime.available() == (True, "")
    assert runtime.ensure_image("any/image:tag", {"username": "u", "password": "p"}) is None
    assert runtime.tasks() == {}
    assert runtime.state(1) is None
    assert runtime.logs_tail(1) == ""
    runtime.stop(1)  # unknown: nothing to do
    runtime.remove(1)


def test_echo_exit_0_state_and_logs(runtime):
    before = time.time()
    runtime.start(spec(1, ["sh", "-c", "echo hello; echo oops >&2"]))
    state = finished(runtime, 1)
    assert state.exit_code == 0
    assert before - 1 <= state.started_at <= state.finished_at <= time.time() + 1
    tail = runtime.logs_tail(1)
    assert "hello\n" in tail and "oops\n" in tail
    assert runtime.tasks() == {1: state}


def test_exit_code_3(runtime):
    runtime.start(spec(2, ["sh", "-c", "exit 3"]))
    assert finished(runtime, 2).exit_code == 3


def test_command_not_found_leaves_nothing(runtime, state_dir):
    with pytest.raises(RuntimeError_, match="command not found: no-such-command-hf"):
        runtime.start(spec(3, ["no-such-command-hf", "--flag"]))
    assert runtime.state(3) is None
    assert runtime.tasks() == {}
    assert not (state_dir / "task-3").exists()
    wait_for(lambda: not processes_mentioning(str(state_dir / "task-3")), what="the supervisor to be gone")


def test_environment_is_clean(runtime, monkeypatch):
    monkeypatch.setenv("HETEROFLOW_AGENT_KEY", "agent-secret-0123456789")
    monkeypatch.setenv("SOME_AGENT_VARIABLE", "agent-only")
    runtime.start(spec(4, ["env"], env={"FOO": "bar baz", "HOME": "/nonexistent-home", "EMPTY": ""}))
    assert finished(runtime, 4).exit_code == 0
    lines = set(runtime.logs_tail(4).splitlines())
    assert {"FOO=bar baz", "HOME=/nonexistent-home", "EMPTY="} <= lines
    assert any(line.startswith("PATH=") for line in lines)
    text = "\n".join(lines)
    assert "HETEROFLOW_AGENT_KEY" not in text and "agent-secret" not in text
    assert "SOME_AGENT_VARIABLE" not in text


def test_bad_environment_name_refused(runtime, state_dir):
    with pytest.raises(RuntimeError_, match="environment variable"):
        runtime.start(spec(5, ["true"], env={"A=B": "x"}))
    assert runtime.tasks() == {}


def test_workdir_given_and_kept(runtime, tmp_path):
    workdir = tmp_path / "work here"
    workdir.mkdir()
    runtime.start(spec(6, ["sh", "-c", "pwd; echo made > out.txt"], workdir=str(workdir)))
    assert finished(runtime, 6).exit_code == 0
    assert runtime.logs_tail(6).splitlines() == [str(workdir)]
    assert (workdir / "out.txt").read_text() == "made\n"
    runtime.remove(6)
    assert (workdir / "out.txt").exists()  # not ours to delete


def test_default_workdir_is_the_tasks_own_and_removed_with_it(runtime, state_dir):
    runtime.start(spec(7, ["sh", "-c", "pwd; echo x > file"]))
    assert finished(runtime, 7).exit_code == 0
    work = Path(runtime.logs_tail(7).strip())
    assert work.is_relative_to(state_dir / "task-7")
    assert (work / "file").exists()
    runtime.remove(7)
    assert not work.exists() and not (state_dir / "task-7").exists()


@pytest.mark.parametrize("workdir", ["relative/dir", "/no/such/dir/hf"])
def test_bad_workdir_refused(runtime, workdir):
    with pytest.raises(RuntimeError_, match="working directory"):
        runtime.start(spec(8, ["true"], workdir=workdir))
    assert runtime.tasks() == {}


def test_volumes_refused(runtime, state_dir, tmp_path):
    volume = Volume(host=str(tmp_path), container="/data")
    with pytest.raises(RuntimeError_, match="cannot mount volumes"):
        runtime.start(spec(9, ["true"], volumes=(volume,)))
    assert runtime.tasks() == {}
    assert not (state_dir / "task-9").exists()


def test_same_task_twice_refused(runtime):
    runtime.start(spec(10, ["sleep", "300"]))
    with pytest.raises(RuntimeError_, match="exists already"):
        runtime.start(spec(10, ["true"]))
    assert runtime.state(10).running


# --- stopping -----------------------------------------------------------------------------


def test_stop_within_grace(runtime):
    runtime.start(spec(11, ["sleep", "300"]))
    assert runtime.state(11).running
    began = time.monotonic()
    runtime.stop(11, grace_seconds=15)
    assert time.monotonic() - began < 10  # SIGTERM did it, the grace was not needed
    state = runtime.state(11)
    assert not state.running and state.exit_code == 128 + signal.SIGTERM
    assert state.finished_at is not None
    runtime.stop(11)  # idempotent
    assert runtime.state(11) == state


def test_sigterm_trapped_is_killed_after_grace(runtime):
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(300)"
    )
    runtime.start(spec(12, [PY, "-c", code]))
    log_line(runtime, 12, "ready")
    began = time.monotonic()
    runtime.stop(12, grace_seconds=1.0)
    elapsed = time.monotonic() - began
    assert 1.0 <= elapsed < 12
    state = runtime.state(12)
    assert not state.running and state.exit_code == 128 + signal.SIGKILL


def test_stop_reaches_the_whole_group_and_session(runtime):
    escaper = "import os, time; os.setpgid(0, 0); print('escaped', os.getpid(), flush=True); time.sleep(300)"
    script = f"sleep 300 & echo child $!; {shlex.quote(PY)} -c {shlex.quote(escaper)} & wait"
    runtime.start(spec(13, ["sh", "-c", script]))
    child = int(log_line(runtime, 13, "child ").split()[1])
    escaped = int(log_line(runtime, 13, "escaped ").split()[1])
    assert alive(child) and alive(escaped)
    assert os.getpgid(escaped) != os.getpgid(child)  # it left the task's process group
    runtime.stop(13, grace_seconds=10)
    assert not runtime.state(13).running
    wait_for(lambda: not alive(child) and not alive(escaped), what="the task's children to be gone")


def test_leftovers_killed_when_the_main_process_ends(runtime):
    runtime.start(spec(14, ["sh", "-c", "sleep 300 & echo child $!"]))
    assert finished(runtime, 14).exit_code == 0
    child = int(log_line(runtime, 14, "child ").split()[1])
    wait_for(lambda: not alive(child), what="the background child to be gone")


# --- surviving the agent --------------------------------------------------------------------


def test_adoption_by_a_new_agent_process(runtime, state_dir):
    """Another agent process starts the task and exits; this one finds it, reads its log
    and stops it."""
    starter = (
        "import sys; from pathlib import Path\n"
        "from heteroflow_agent.runtime.base import TaskSpec\n"
        "from heteroflow_agent.runtime.process import ProcessRuntime\n"
        "ProcessRuntime(Path(sys.argv[1])).start(TaskSpec(15, 'x', ['sh', '-c', 'echo adopted me; exec sleep 300']))\n"
    )
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(AGENT_DIR)}
    subprocess.run([PY, "-c", starter, str(state_dir)], env=env, check=True, timeout=60)

    adopter = ProcessRuntime(state_dir)
    tasks = adopter.tasks()
    assert list(tasks) == [15] and tasks[15].running and tasks[15].exit_code is None
    assert log_line(adopter, 15, "adopted") == "adopted me"
    command = read(state_dir, 15, supervise.COMMAND_FILE)
    assert alive(command["pid"], command["start_ticks"])

    adopter.stop(15, grace_seconds=10)
    state = adopter.state(15)
    assert not state.running and state.exit_code == 128 + signal.SIGTERM
    assert not alive(command["pid"], command["start_ticks"])
    adopter.remove(15)
    assert runtime.tasks() == {}


def test_adoption_by_a_new_instance(runtime, state_dir):
    runtime.start(spec(16, ["sh", "-c", "echo one; exec sleep 300"]))
    other = ProcessRuntime(state_dir)
    assert other.tasks()[16].running
    assert log_line(other, 16, "one") == "one"
    other.stop(16, grace_seconds=5)
    assert runtime.state(16).exit_code == 128 + signal.SIGTERM


def test_supervisor_killed_means_not_running_and_unknown_exit(runtime, state_dir):
    runtime.start(spec(17, ["sleep", "300"]))
    supervisor = read(state_dir, 17, supervise.TASK_FILE)["supervisor"]
    command = read(state_dir, 17, supervise.COMMAND_FILE)
    assert alive(supervisor["pid"], supervisor["start_ticks"])
    os.kill(supervisor["pid"], signal.SIGKILL)
    state = finished(runtime, 17)
    assert state.exit_code is None and state.finished_at is None
    assert not alive(command["pid"], command["start_ticks"])  # died with its supervisor
    assert ProcessRuntime(state_dir).tasks() == {17: state}
    runtime.stop(17)  # nothing left to stop
    runtime.remove(17)
    assert not (state_dir / "task-17").exists()


def test_a_start_cut_short_is_listed_as_ended_and_removable(runtime, state_dir):
    (state_dir / "task-18").mkdir(parents=True)  # an agent died in the middle of start()
    (state_dir / "junk").mkdir()
    (state_dir / "task-x").mkdir()
    assert runtime.tasks() == {18: runtime.state(18)}
    state = runtime.state(18)
    assert not state.running and state.exit_code is None
    assert state.started_at is not None  # so that the reconciler can age it out
    runtime.remove(18)
    assert runtime.tasks() == {}


# --- removing, logs -------------------------------------------------------------------------


def test_remove_running_refused_finished_cleaned(runtime, state_dir):
    runtime.start(spec(19, ["sleep", "300"]))
    with pytest.raises(RuntimeError_, match="still running"):
        runtime.remove(19)
    assert runtime.state(19).running
    runtime.stop(19, grace_seconds=5)
    runtime.remove(19)
    assert runtime.state(19) is None
    assert not (state_dir / "task-19").exists()
    runtime.remove(19)  # idempotent


def test_logs_tail_returns_only_the_last_lines(runtime):
    runtime.start(spec(20, ["seq", "1", "100000"]))  # ~590 KB, more than one read block
    assert finished(runtime, 20).exit_code == 0
    assert runtime.logs_tail(20, lines=10).splitlines() == [str(n) for n in range(99991, 100001)]
    default = runtime.logs_tail(20).splitlines()
    assert len(default) == 200 and default[-1] == "100000"
    assert runtime.logs_tail(20, lines=0) == ""


def test_logs_tail_of_a_silent_task(runtime):
    runtime.start(spec(21, ["true"]))
    assert finished(runtime, 21).exit_code == 0
    assert runtime.logs_tail(21) == ""
