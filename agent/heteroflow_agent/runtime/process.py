"""The process runtime: a task runs as a process group on the host, for machines without a
container engine (the node's operator enables it). Linux only (it reads /proc).

What a container gave and what takes its place here:
- image: ignored; `ensure_image` does nothing.
- environment: a clean one, never the agent's (which holds the agent key): PATH (the
  agent's, else a standard one), HOME, USER and LOGNAME of the agent's user, LANG=C.UTF-8,
  then the spec's env over them.
- working directory: spec.workdir (an existing absolute directory; it is not created), or
  a directory of the task's own under the state directory, removed with the task.
- volumes: there is no mount namespace to bind them into, so a spec with volumes is
  refused (RuntimeError_) rather than run with paths that do not exist for it.
- ipc_host, shm_size_mb, host_port: nothing to do, the task is on the host already.
- logs: stdout and stderr go to one file under the state directory.
- user: the operator's unprivileged user (`process_user`, HETEROFLOW_PROCESS_USER; see
  task_user), to which the supervisor switches before the command starts (its groups
  as the system lists them, HOME, USER and LOGNAME its own); the task's own working
  directory is given to it. Without one the task runs as the agent's user, and an agent
  running as root refuses that unless the operator allows it (`process_run_as_root`).
- no isolation: no resource limits, and the task sees the host's GPUs unless the spec's
  env (CUDA_VISIBLE_DEVICES...) says otherwise; all tasks run as the same user.

Each task is started through a small supervisor (`supervise.py`, detached in a session
of its own) that runs the command, waits for it and writes its exit code to the task's
state directory. So the outcome survives the agent: a new agent (a new ProcessRuntime on
the same state directory) lists the task, tells whether it runs and how it ended, stops
it and reads its log. State directory layout:

    STATE_DIR/                  0700 (0711 with a task user: it may pass, not list)
      task-{id}/                0700 (0711 likewise), one per task, removed by remove()
        task.json               by the runtime, before the command starts: the command, the
                                working directory, the supervisor (pid, start ticks)
        command.json            by the supervisor, as the command starts: its pid (= its
                                process group and session id) and start ticks
        exit.json               by the supervisor, when the command has ended: exit_code
                                (128+N for signal N), signal, finished_at
        output.log              stdout and stderr of the command
        work/                   the working directory, when the spec names none (the
                                task user's, 0700)

The records and the log stay the agent's (0600): a task run as another user can neither
read nor forge them (its output reaches the log through the descriptor it inherits).

A process is named by (pid, start ticks since boot from /proc/PID/stat): the same datum
psutil's create_time is computed from, but compared exactly and immune to wall-clock
changes, so a reused pid is never mistaken for the task.

A task runs while its supervisor lives, or, if the supervisor is gone, while anything of
the command's session lives. The supervisor's death kills the command's main process
(parent-death signal); a task whose supervisor died without writing exit.json is
reported as not running with exit_code None. Stopping signals the command's process
group and the rest of its session; a process that started a session of its own
(setsid, daemonising) has left the task and is not found again (a container would hold
it; this runtime cannot).

Deployment note: the supervisors belong to the agent's cgroup. Under systemd the agent's
unit needs KillMode=process (or mixed) for tasks to survive an agent restart; with the
default (control-group), stopping the agent sends SIGTERM to every task as well, which
the supervisors forward and record as an exit code 143.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from heteroflow_agent.runtime import supervise
from heteroflow_agent.runtime.base import (
    LOG_TAIL_LINES,
    OUTPUT_READ_BYTES,
    OutputLine,
    OutputRead,
    Runtime,
    RuntimeError_,
    TaskReach,
    TaskSpec,
    TaskState,
    split_output,
    task_name,
)

logger = logging.getLogger("heteroflow_agent.runtime.process")

TASK_DIR = re.compile(r"^task-(\d+)$")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HANDSHAKE_TIMEOUT = 30.0  # seconds for the supervisor to start and answer, on a busy host
KILL_TIMEOUT = 10.0  # seconds for a SIGKILLed task to be gone (its exit code written)
SUPERVISOR_EXIT_SECONDS = 5.0  # for a supervisor that wrote the outcome to exit, on a busy host
POLL_INTERVAL = 0.05
TAIL_BLOCK = 64 * 1024
TAIL_MAX_BYTES = 4 * 1024 * 1024  # logs_tail reads no further back than this


def _read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _identified(process: dict | None, *, alive: bool) -> bool:
    """The recorded process ({"pid", "start_ticks"}) is still there (alive: and not a
    zombie), and is the same process, not another one with its pid."""
    if not process or not isinstance(process.get("pid"), int):
        return False
    stat = supervise.proc_stat(process["pid"])
    if stat is None or stat[3] != process.get("start_ticks"):
        return False
    return supervise.is_alive(stat) if alive else True


@dataclass(frozen=True)
class TaskUser:
    """The user the process runtime's tasks run as, when it is not the agent's own: the
    supervisor (the agent's user, root) switches to it before the command starts."""

    name: str
    uid: int
    gid: int
    home: str
    groups: tuple[int, ...]  # every group the system lists it in, its primary one included


class ProcessUserRefused(RuntimeError_):
    """The process runtime will not run tasks as configured; the message tells the
    operator what to set."""


ROOT_REFUSED = (
    "the agent runs as root and would run process-runtime tasks as root: name an unprivileged user for "
    "them (HETEROFLOW_PROCESS_USER, or process_user in the agent's configuration, e.g. a dedicated "
    "heteroflow-task account), run the agent itself as an unprivileged user (User= in its systemd unit), "
    "or allow root explicitly (HETEROFLOW_PROCESS_RUN_AS_ROOT=true)"
)


def task_user(name: str, *, allow_root: bool = False, euid: int | None = None) -> TaskUser | None:
    """Who the process runtime's tasks run as, from the operator's `process_user` (a name
    or a uid; "" none) and `process_run_as_root`, for an agent of effective uid `euid`
    (its own by default). None: as the agent's own user (it is not root; or it is and
    root is allowed; or the user named is the agent's own). Raises ProcessUserRefused:
    tasks would run as root without the operator's leave, the user does not exist, or
    an agent that is not root names another user (only root can switch)."""
    euid = os.geteuid() if euid is None else euid
    if not name:
        if euid == 0 and not allow_root:
            raise ProcessUserRefused(ROOT_REFUSED)
        return None
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, OverflowError):
        raise ProcessUserRefused(f"process_user {name!r}: no such user on this host") from None
    if entry.pw_uid == 0 and not allow_root:
        raise ProcessUserRefused(f"process_user {name!r} is root (uid 0): {ROOT_REFUSED}")
    if entry.pw_uid == euid:
        return None
    if euid != 0:
        raise ProcessUserRefused(
            f"process_user {name!r}: only an agent running as root can run tasks as another user (this one "
            f"runs as uid {euid}); leave process_user out to run them as the agent's own user"
        )
    groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
    return TaskUser(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir or "/", groups)


def _base_environment(user: TaskUser | None = None) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH") or DEFAULT_PATH, "LANG": "C.UTF-8"}
    if user is not None:
        env.update(HOME=user.home, USER=user.name, LOGNAME=user.name)
        return env
    try:
        own = pwd.getpwuid(os.getuid())
    except KeyError:
        env["HOME"] = "/"
    else:
        env.update(HOME=own.pw_dir or "/", USER=own.pw_name, LOGNAME=own.pw_name)
    return env


class _Task:
    """One task's state directory, read fresh on every call (no cache: another agent
    process may have started it, the supervisor writes in it)."""

    def __init__(self, directory: Path, task_id: int):
        self.dir = directory
        self.task_id = task_id

    @property
    def record(self) -> dict | None:
        return _read_json(self.dir / supervise.TASK_FILE)

    @property
    def command(self) -> dict | None:
        return _read_json(self.dir / supervise.COMMAND_FILE)

    @property
    def outcome(self) -> dict | None:
        data = _read_json(self.dir / supervise.EXIT_FILE)
        if data is None or not isinstance(data.get("exit_code"), int):
            return None
        return data

    def members(self, command: dict, *, leader_gone: bool) -> list[int]:
        sid = command.get("sid", command.get("pid"))
        if not isinstance(sid, int):
            return []
        return supervise.session_members(sid, int(command.get("start_ticks") or 0), leader_gone=leader_gone)

    def running(self, record: dict | None = None) -> bool:
        record = record if record is not None else self.record
        if record is None:
            return False
        if _identified(record.get("supervisor"), alive=True):
            return True
        command = self.command
        if command is None:
            return False
        if _identified(command, alive=True):
            return True
        return bool(self.members(command, leader_gone=True))

    def signal(self, signum: int) -> None:
        """Send the signal to the command's group and the rest of its session (to the
        supervisor itself when the command has not started yet)."""
        record = self.record or {}
        command = self.command
        if command is None:
            supervisor = record.get("supervisor")
            if _identified(supervisor, alive=True):
                _kill(supervisor["pid"], signum)
            return
        leader_there = _identified(command, alive=False)  # a zombie still holds the group
        if leader_there:
            try:
                os.killpg(command["pgid"], signum)
            except OSError:
                pass
        for pid in self.members(command, leader_gone=not leader_there):
            _kill(pid, signum)

    def state(self) -> TaskState:
        record = self.record
        outcome = self.outcome
        if outcome is None and record is not None and self.running(record):
            return TaskState(self.task_id, running=True, started_at=self._started_at(record))
        if outcome is None:
            outcome = self.outcome  # it may have ended between the two looks
        return TaskState(
            self.task_id,
            running=False,
            exit_code=outcome["exit_code"] if outcome else None,
            started_at=self._started_at(record),
            finished_at=outcome.get("finished_at") if outcome else None,
        )

    def _started_at(self, record: dict | None) -> float | None:
        command = self.command
        for source in (command, record):
            if source and isinstance(source.get("started_at"), (int, float)):
                return float(source["started_at"])
        try:  # a start cut short (the agent died in it): when its directory was made
            return os.stat(self.dir).st_mtime
        except OSError:
            return None


def _recorded_user(user: dict | None) -> tuple[int, int, tuple[int, ...]] | None:
    """(uid, gid, groups) of the user a task was started as (task.json), None for the
    agent's own."""
    if not user or not isinstance(user.get("uid"), int):
        return None
    try:
        entry = pwd.getpwuid(user["uid"])
    except KeyError:
        return (user["uid"], user["uid"], ())
    return (entry.pw_uid, entry.pw_gid, tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid)))))


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL)


class ProcessRuntime(Runtime):
    kind = "process"

    def __init__(self, state_dir: Path, user: TaskUser | None = None):
        """`user`: whom its tasks run as (task_user); None, the agent's own user."""
        self.state_dir = Path(state_dir)
        self.user = user
        self._lock = threading.Lock()
        self._starting: set[int] = set()

    def reach_problem(self) -> str:
        """With a task user: the first directory above the state directory it cannot pass
        (its tasks then find their working directory by relative paths only), in words;
        "" when there is none (or no user)."""
        user = self.user
        if user is None:
            return ""
        for directory in reversed(self.state_dir.resolve().parents):
            try:
                info = os.stat(directory)
            except OSError:
                break  # not made yet: the runtime makes it, passable
            mode = info.st_mode
            if info.st_uid == user.uid:
                passes = mode & 0o100
            elif info.st_gid in user.groups:
                passes = mode & 0o010
            else:
                passes = mode & 0o001
            if not passes:
                return (
                    f"{user.name} cannot pass {directory} (mode {mode & 0o777:04o}): its tasks will reach their "
                    "working directory only by relative paths; let others pass (chmod o+x) the directories above "
                    "the agent's data directory"
                )
        return ""

    # --- Runtime --------------------------------------------------------------------

    def available(self) -> tuple[bool, str]:
        if not os.path.isdir("/proc/self"):
            return False, "the process runtime needs Linux (/proc)"
        return True, ""

    def ensure_image(self, image: str, credentials: dict | None = None) -> None:
        return None  # no images: the command runs on the host

    def start(self, spec: TaskSpec) -> None:
        command, env, cwd = self._check(spec)
        with self._lock:
            if spec.task_id in self._starting:
                raise RuntimeError_(f"{spec.name} is being started already")
            self._starting.add(spec.task_id)
        try:
            self._start(spec, command, env, cwd)
        finally:
            with self._lock:
                self._starting.discard(spec.task_id)

    def state(self, task_id: int) -> TaskState | None:
        task = self._task(task_id)
        if task is None:
            return None
        return task.state()

    def stop(self, task_id: int, grace_seconds: float = 10.0) -> None:
        task = self._task(task_id)
        if task is None or task.outcome is not None or not task.running():
            return
        task.signal(signal.SIGTERM)
        if _wait_until(lambda: not task.running(), max(0.0, grace_seconds)):
            return
        logger.info("%s did not stop within %ss of SIGTERM: killing it", task_name(task_id), grace_seconds)
        task.signal(signal.SIGKILL)
        if not _wait_until(lambda: not task.running(), KILL_TIMEOUT):
            raise RuntimeError_(f"{task_name(task_id)} is still running {KILL_TIMEOUT:.0f}s after SIGKILL")

    def logs_tail(self, task_id: int, lines: int = LOG_TAIL_LINES) -> str:
        if lines <= 0:
            return ""
        task = self._task(task_id)
        if task is None:
            return ""
        try:
            with open(task.dir / supervise.LOG_FILE, "rb") as handle:
                data = _tail(handle, lines)
        except OSError:
            return ""
        return "".join(data.decode("utf-8", "replace").splitlines(keepends=True)[-lines:])

    def read_output(self, task_id: int, cursor: dict | None, limit: int = OUTPUT_READ_BYTES) -> OutputRead:
        offset = int((cursor or {}).get("offset", 0))
        task = self._task(task_id)
        if task is None:
            return OutputRead([], {"offset": offset})
        ended = not task.running()  # read before the file: all it wrote is there then
        try:
            with open(task.dir / supervise.LOG_FILE, "rb") as handle:
                handle.seek(offset)
                data = handle.read(limit)
        except OSError:
            return OutputRead([], {"offset": offset})
        pieces, used = split_output(data, final=ended and len(data) < limit)
        now = time.time()
        # one file for both streams (the supervisor's stdout and stderr): "stdout"
        lines = [OutputLine(now, "stdout", piece.decode("utf-8", "replace")) for piece in pieces]
        return OutputRead(lines, {"offset": offset + used})

    def remove(self, task_id: int) -> None:
        task = self._task(task_id)
        if task is None:
            return
        # the supervisor records the outcome, then exits: a task that has its outcome is
        # given a moment for that exit (a loaded machine seen between the two, in CI)
        ending = task.outcome is not None
        if task.running() and not (ending and _wait_until(lambda: not task.running(), SUPERVISOR_EXIT_SECONDS)):
            raise RuntimeError_(f"{task_name(task_id)} is still running: stop it before removing it")
        shutil.rmtree(task.dir, ignore_errors=True)
        if task.dir.exists():
            raise RuntimeError_(f"cannot remove {task.dir}")

    def tasks(self) -> dict[int, TaskState]:
        try:
            names = os.listdir(self.state_dir)
        except OSError:
            return {}
        found = {}
        for name in names:
            match = TASK_DIR.match(name)
            if not match or not (self.state_dir / name).is_dir():
                continue
            task_id = int(match.group(1))
            task = self._task(task_id)
            if task is not None:
                found[task_id] = task.state()
        return found

    def reach(self, task_id: int) -> TaskReach | None:
        """A running task on the host's localhost: its processes (the command's session),
        whose listening ports are its own; its main process's environment; its working
        directory and user."""
        task = self._task(task_id)
        record = task.record if task is not None else None
        command = task.command if task is not None else None
        if record is None or command is None or task.outcome is not None or not _identified(command, alive=True):
            return None
        pid = command["pid"]
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                raw = handle.read()
        except OSError:
            return None
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        pids = frozenset({pid, *task.members(command, leader_gone=False)})
        return TaskReach(
            task_id,
            "127.0.0.1",
            pids=pids,
            env={key.decode(errors="replace"): value.decode(errors="replace") for key, value in env.items()},
            cwd=record.get("cwd") or None,
            user=_recorded_user(record.get("user")),
        )

    # --- inside ---------------------------------------------------------------------

    def _task(self, task_id: int) -> _Task | None:
        with self._lock:
            if task_id in self._starting:
                return None  # not held until start() has returned
        directory = self.state_dir / task_name(task_id)
        if not directory.is_dir():
            return None
        return _Task(directory, task_id)

    def _check(self, spec: TaskSpec) -> tuple[list[str], dict[str, str], str | None]:
        if not isinstance(spec.task_id, int) or isinstance(spec.task_id, bool) or spec.task_id < 0:
            raise RuntimeError_(f"bad task id {spec.task_id!r}")
        if spec.volumes:
            mounts = ", ".join(f"{v.host}:{v.container}" for v in spec.volumes)
            raise RuntimeError_(
                f"the process runtime cannot mount volumes (no container to mount them in): {mounts}; "
                "run this task on a node with a container engine, or give it host paths in its command"
            )
        command = list(spec.command or ())
        if not command or not all(isinstance(part, str) for part in command) or not command[0]:
            raise RuntimeError_("the task has no command (the process runtime has no image entrypoint)")
        if any("\0" in part for part in command):
            raise RuntimeError_("the command contains a NUL character")
        env = _base_environment(self.user)
        for key, value in (spec.env or {}).items():
            if not isinstance(key, str) or not key or "=" in key or "\0" in key:
                raise RuntimeError_(f"bad environment variable name {key!r}")
            if not isinstance(value, str) or "\0" in value:
                raise RuntimeError_(f"bad value for environment variable {key}")
            env[key] = value
        cwd = spec.workdir
        if cwd is not None:
            if not os.path.isabs(cwd):
                raise RuntimeError_(f"working directory {cwd} is not an absolute path")
            if not os.path.isdir(cwd):
                raise RuntimeError_(f"working directory {cwd} does not exist on this host")
        return command, env, cwd

    def _start(self, spec: TaskSpec, command: list[str], env: dict[str, str], cwd: str | None) -> None:
        # with a task user, the directories on the way to its working directory let it
        # pass (so its absolute paths resolve) but not list them
        passable = 0o711 if self.user is not None else 0o700
        try:
            self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.user is not None:
                os.chmod(self.state_dir, passable)
        except OSError as error:
            raise RuntimeError_(f"cannot create the state directory {self.state_dir}: {error}") from error
        directory = self.state_dir / spec.name
        try:
            directory.mkdir(mode=0o700)
            os.chmod(directory, passable)
        except FileExistsError:
            raise RuntimeError_(f"{spec.name} exists already (remove it first)") from None
        except OSError as error:
            raise RuntimeError_(f"cannot create {directory}: {error}") from error

        launched: dict = {}  # what _launch got to, for undoing it
        try:
            if cwd is None:
                work = directory / supervise.WORK_DIR
                work.mkdir(mode=0o700)
                if self.user is not None:
                    os.chown(work, self.user.uid, self.user.gid)
                cwd = str(work)
            self._launch(spec, directory, command, env, cwd, launched)
        except BaseException as error:
            self._undo(directory, launched.get("supervisor"))
            if isinstance(error, RuntimeError_) or not isinstance(error, Exception):
                raise
            raise RuntimeError_(f"cannot start {spec.name}: {error}") from error

    def _launch(self, spec: TaskSpec, directory: Path, command: list[str], env: dict, cwd: str, launched: dict) -> None:
        """Start the supervisor, record it, let it run the command. Raises when anything
        fails, with launched["supervisor"] set once there is a supervisor to kill."""
        ours, theirs = socket.socketpair()
        channel = None
        try:
            log_fd = os.open(directory / supervise.LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                launcher = subprocess.Popen(
                    [sys.executable, "-I", supervise.__file__, str(directory), str(theirs.fileno())],
                    env={"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"},
                    cwd="/",
                    stdin=subprocess.DEVNULL,
                    stdout=log_fd,
                    stderr=log_fd,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
            except OSError as error:
                raise RuntimeError_(f"cannot start the supervisor ({sys.executable}): {error}") from error
            finally:
                theirs.close()
                os.close(log_fd)
            try:
                launcher.wait(timeout=HANDSHAKE_TIMEOUT)  # it forks the supervisor and exits
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
                raise RuntimeError_("the supervisor did not start in time") from None

            ours.settimeout(HANDSHAKE_TIMEOUT)
            channel = ours.makefile("rwb")
            hello = _receive(channel)
            pid = hello.get("hello") if hello else None
            if not isinstance(pid, int):
                raise RuntimeError_(f"the supervisor did not start: {self._log_hint(directory)}")
            stat = supervise.proc_stat(pid)
            if not supervise.is_alive(stat):
                raise RuntimeError_("the supervisor ended as it started")
            supervisor = launched["supervisor"] = {"pid": pid, "start_ticks": stat[3]}
            supervise.write_json_atomic(
                str(directory / supervise.TASK_FILE),
                {
                    "version": 1,
                    "task_id": spec.task_id,
                    "name": spec.name,
                    "command": command,
                    "cwd": cwd,
                    "created_workdir": spec.workdir is None,
                    "labels": dict(spec.labels or {}),
                    "started_at": time.time(),
                    "supervisor": supervisor,
                    "user": {"name": self.user.name, "uid": self.user.uid} if self.user is not None else None,
                },
            )
            go = {"command": command, "env": env, "cwd": cwd}
            if self.user is not None:
                go["user"] = {"uid": self.user.uid, "gid": self.user.gid, "groups": list(self.user.groups)}
            channel.write(json.dumps({"go": go}).encode() + b"\n")
            channel.flush()
            reply = _receive(channel)
            if reply is None:
                raise RuntimeError_(f"the supervisor ended before starting the command: {self._log_hint(directory)}")
            if "error" in reply:
                raise RuntimeError_(str(reply["error"]))
            if not isinstance(reply.get("started"), dict):
                raise RuntimeError_(f"unexpected answer from the supervisor: {reply!r}")
            logger.info("started %s (supervisor %s, pid %s)", spec.name, pid, reply["started"].get("pid"))
        finally:
            if channel is not None:
                channel.close()
            ours.close()

    def _undo(self, directory: Path, supervisor: dict | None) -> None:
        """A start failed: kill whatever it started and leave nothing behind."""
        task = _Task(directory, -1)
        if _identified(supervisor, alive=True):
            _kill(supervisor["pid"], signal.SIGKILL)  # its command dies with it (parent-death signal)
        task.signal(signal.SIGKILL)
        _wait_until(lambda: not _identified(supervisor, alive=True) and not _command_alive(task), KILL_TIMEOUT)
        shutil.rmtree(directory, ignore_errors=True)

    @staticmethod
    def _log_hint(directory: Path) -> str:
        try:
            text = (directory / supervise.LOG_FILE).read_text(errors="replace").strip()
        except OSError:
            text = ""
        return text.splitlines()[-1] if text else "no message"


def _command_alive(task: _Task) -> bool:
    command = task.command
    return command is not None and (_identified(command, alive=True) or bool(task.members(command, leader_gone=True)))


def _receive(channel) -> dict | None:
    try:
        line = channel.readline()
    except (TimeoutError, OSError):
        return None
    if not line:
        return None
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def _tail(handle, lines: int) -> bytes:
    """The end of the file holding at least `lines` whole lines (or the whole file, or
    TAIL_MAX_BYTES)."""
    handle.seek(0, os.SEEK_END)
    position = handle.tell()
    data = b""
    while position > 0 and len(data) < TAIL_MAX_BYTES:
        step = min(TAIL_BLOCK, position)
        position -= step
        handle.seek(position)
        data = handle.read(step) + data
        if data.count(b"\n") > lines:
            break
    return data
