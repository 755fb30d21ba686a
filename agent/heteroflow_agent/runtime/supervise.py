"""The supervisor of one process-runtime task: it runs the task's command, waits for it
and writes its exit code, so that the outcome survives the agent that started it.

    python -I .../supervise.py STATE_DIR/task-{id} SOCKET_FD

It is started by `ProcessRuntime.start` and is standard library only, run as a script
(never as part of the package), so that it depends on nothing the task's environment or
an agent upgrade could change. The conversation with the runtime, one JSON object a line
over the inherited socket:

    supervisor -> runtime   {"hello": PID}            after detaching (see below)
    runtime -> supervisor   {"go": {"command": [...], "env": {...}, "cwd": "...",
                                    "user": {"uid", "gid", "groups"} (when tasks run as
                                    another user than the agent's)}}
                            (sent once the runtime has recorded the supervisor in task.json;
                            EOF instead: the supervisor exits, nothing was started)
    supervisor -> runtime   {"started": {...}} or {"error": "why"}

Detaching: the runtime starts this script in a new session; it forks at once and the
parent exits, so the supervisor is nobody's child in the agent (no zombie to reap, the
same situation for a task this agent started and for one it adopted after a restart).

The command runs in a session (and process group) of its own, pgid = sid = its pid, with
stdout and stderr on the supervisor's own (the task's log file), and with a parent-death
signal: if the supervisor is killed, the command is killed with it (nobody would be left
to record its outcome). With a `user`, the command runs as that user: its groups, then
its gid, then its uid are set in the child after it has entered its working directory
and before the command starts (the parent-death signal is set after the switch, which
would clear it); the supervisor stays the agent's user, so the task can neither stop it
nor write its records. The supervisor forwards SIGTERM, SIGINT and SIGHUP to the
command's group and keeps waiting. When the command's main process ends, what is left of
its session is killed (a container's end, too), then `exit.json` is written atomically:
the exit code, 128 + N for a signal N, like a shell.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

TASK_FILE = "task.json"  # written by the runtime, before the command starts
COMMAND_FILE = "command.json"  # written here, once the command runs
EXIT_FILE = "exit.json"  # written here, when the command has ended
LOG_FILE = "output.log"
WORK_DIR = "work"

GO_TIMEOUT = 120.0  # seconds to wait for the runtime's "go" before giving up
LEFTOVER_KILL_SECONDS = 5.0

PR_SET_PDEATHSIG = 1
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# --- shared with the runtime (heteroflow_agent.runtime.process imports these) ----------


def write_json_atomic(path: str, data: dict) -> None:
    """Write the file whole or not at all (a reader sees the old file or the new one)."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, pgid, sid, start ticks since boot) of a process, None when there is none.
    The start ticks never change for a process and are not affected by the wall clock:
    (pid, start ticks) names a process even across pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except (OSError, ValueError):
        return None
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return fields[0].decode("ascii", "replace"), int(fields[2]), int(fields[3]), int(fields[19])
    except (ValueError, IndexError):
        return None


def is_alive(stat: tuple[str, int, int, int] | None) -> bool:
    return stat is not None and stat[0] not in ("Z", "X", "x")


def session_members(sid: int, min_ticks: int, *, leader_gone: bool = False) -> list[int]:
    """Live processes of the session `sid` started no earlier than `min_ticks`. With the
    session's leader gone, a process whose pid is the sid is another session (pid reuse)."""
    members = []
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return members
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me or (leader_gone and pid == sid):
            continue
        stat = proc_stat(pid)
        if is_alive(stat) and stat[2] == sid and stat[3] >= min_ticks:
            members.append(pid)
    return members


# --- the supervisor -------------------------------------------------------------------


class _Channel:
    def __init__(self, fd: int):
        self.sock = socket.socket(fileno=fd)
        self.reader = self.sock.makefile("rb")

    def send(self, message: dict) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def receive(self) -> dict | None:
        line = self.reader.readline()
        if not line:
            return None
        return json.loads(line)

    def close(self) -> None:
        for closable in (self.reader, self.sock):
            try:
                closable.close()
            except OSError:
                pass


def _set_parent_death_signal(parent: int):
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        prctl = None

    def in_child() -> None:  # between fork and exec: no allocation-heavy work
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died before the line above
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


def _describe_start_error(error: OSError, command: list[str], cwd: str) -> str:
    name = command[0]
    if getattr(error, "filename", None) == cwd:
        return f"working directory {cwd}: {error.strerror or error}"
    if isinstance(error, FileNotFoundError):
        return f"command not found: {name}"
    if isinstance(error, PermissionError):
        return f"command not executable: {name} (permission denied)"
    return f"cannot run {name}: {error.strerror or error}"


def _exit_code(info) -> tuple[int, int | None]:
    if info.si_code == os.CLD_EXITED:
        return info.si_status, None
    return 128 + info.si_status, info.si_status  # killed or dumped


def _kill_leftovers(pid: int, ticks: int) -> None:
    """The main process has ended (a zombie, not reaped yet, so its pid and pgid are still
    ours): kill what is left of its group and session."""
    deadline = time.monotonic() + LEFTOVER_KILL_SECONDS
    while True:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        members = session_members(pid, ticks)
        for member in members:
            try:
                os.kill(member, signal.SIGKILL)
            except OSError:
                pass
        if not members or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def supervise(task_dir: str, fd: int) -> int:
    channel = _Channel(fd)
    channel.send({"hello": os.getpid()})
    channel.sock.settimeout(GO_TIMEOUT)
    try:
        message = channel.receive()
    except (OSError, ValueError):
        message = None
    go = (message or {}).get("go")
    if not isinstance(go, dict):
        return 0  # the runtime gave up: nothing was started

    state: dict = {"child": None, "reaped": False, "pending": []}

    def forward(signum, _frame):
        child = state["child"]
        if child is None:
            state["pending"].append(signum)
            return
        if state["reaped"]:
            return
        try:
            os.killpg(child.pid, signum)
        except OSError:
            pass

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)

    command, env, cwd = list(go["command"]), dict(go["env"]), str(go["cwd"])
    user = go.get("user")
    switch = {}
    if isinstance(user, dict):
        switch = {"user": int(user["uid"]), "group": int(user["gid"]), "extra_groups": list(user.get("groups", []))}
    try:
        child = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
            preexec_fn=_set_parent_death_signal(os.getpid()),
            **switch,
        )
    except (OSError, subprocess.SubprocessError, ValueError, TypeError) as error:
        if isinstance(error, OSError):
            why = _describe_start_error(error, command, cwd)
        else:
            why = f"cannot run {command[0] if command else '(nothing)'}: {error}"
        try:
            channel.send({"error": why})
        except OSError:
            pass
        return 127

    started_at = time.time()
    stat = proc_stat(child.pid)
    ticks = stat[3] if stat else 0
    record = {"pid": child.pid, "pgid": child.pid, "sid": child.pid, "start_ticks": ticks, "started_at": started_at}
    try:
        write_json_atomic(os.path.join(task_dir, COMMAND_FILE), record)
    except OSError as error:
        # nobody could find the command again: do not leave it running unknown
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        try:
            channel.send({"error": f"cannot record the command: {error}"})
        except OSError:
            pass
        channel.close()
        return 127
    try:
        channel.send({"started": record})
    except OSError:
        pass  # the runtime is gone; the task is recorded, a later one adopts it
    channel.close()
    state["child"] = child
    for signum in state["pending"]:
        forward(signum, None)

    # WNOWAIT: the ended command stays a zombie, holding its pid and group id, until the
    # leftovers of its session are killed; only then is it reaped.
    info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    code, killed_by = _exit_code(info)
    _kill_leftovers(child.pid, ticks)
    try:
        os.waitpid(child.pid, 0)
    except ChildProcessError:
        pass
    state["reaped"] = True
    child.returncode = code  # reaped above: keep Popen from trying again
    write_json_atomic(
        os.path.join(task_dir, EXIT_FILE),
        {"exit_code": code, "signal": killed_by, "finished_at": time.time()},
    )
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: supervise.py TASK_DIR SOCKET_FD", file=sys.stderr)
        return 2
    task_dir, fd = argv[0], int(argv[1])
    if os.fork():  # detach: the runtime reaps this parent, init adopts the supervisor
        os._exit(0)
    try:
        return supervise(task_dir, fd)
    except BaseException as error:  # the log is the only place left to say it
        print(f"heteroflow supervisor: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))
