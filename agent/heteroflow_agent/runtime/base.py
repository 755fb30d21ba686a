"""The Runtime interface: how the executor starts, watches and stops a task, whatever
runs it. Two implementations: `docker` (any Docker-compatible engine, through the docker
SDK) and `process` (a child process group, for machines without a container engine,
enabled by the node's operator).

Every task is named `task-{id}` in its runtime, and a runtime can list the tasks it
holds, also those started by a previous agent process, so that a restarted agent adopts
them instead of losing them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

LOG_TAIL_LINES = 200
OUTPUT_READ_BYTES = 1024 * 1024  # one read of a task's output, at most about this
MAX_LINE_BYTES = 16 * 1024  # a longer line is cut into pieces of this


@dataclass(frozen=True)
class OutputLine:
    at: float  # seconds since the epoch: when the engine logged it, else when it was read
    stream: str  # "stdout" or "stderr" (the process runtime's one file: "stdout")
    text: str  # without its newline


@dataclass(frozen=True)
class OutputRead:
    lines: list[OutputLine]
    cursor: dict


def split_output(data: bytes, *, final: bool) -> tuple[list[bytes], int]:
    """Whole lines of `data` (without their newline; one longer than MAX_LINE_BYTES in
    pieces) and how many bytes they took. A last line without its newline is left for
    the next read, unless `final` or it is already MAX_LINE_BYTES long."""
    lines: list[bytes] = []
    start = 0
    while True:
        end = data.find(b"\n", start)
        if end < 0:
            rest = data[start:]
            if rest and (final or len(rest) >= MAX_LINE_BYTES):
                keep = len(rest) if final else len(rest) - len(rest) % MAX_LINE_BYTES
                lines.extend(_pieces(rest[:keep]))
                start += keep
            return lines, start
        lines.extend(_pieces(data[start:end].rstrip(b"\r")))
        start = end + 1


def _pieces(line: bytes) -> list[bytes]:
    return [line[i : i + MAX_LINE_BYTES] for i in range(0, len(line), MAX_LINE_BYTES)] or [b""]


def task_name(task_id: int) -> str:
    return f"task-{task_id}"


class RuntimeError_(RuntimeError):
    """A runtime could not do what was asked; the message says why, for the task's report."""


@dataclass(frozen=True)
class Volume:
    host: str
    container: str
    read_only: bool = False


@dataclass(frozen=True)
class TaskSpec:
    """Everything a runtime needs to start one task. The executor has already checked
    volumes, dropped bad env entries and set the GPU visibility variables."""

    task_id: int
    image: str  # ignored by the process runtime
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    volumes: tuple[Volume, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    host_port: int | None = None
    ipc_host: bool = False
    shm_size_mb: int | None = None

    @property
    def name(self) -> str:
        return task_name(self.task_id)


@dataclass(frozen=True)
class TaskState:
    """What the runtime knows about a task it holds."""

    task_id: int
    running: bool
    exit_code: int | None = None  # None while running (or when the runtime cannot tell)
    started_at: float | None = None  # seconds since the epoch
    finished_at: float | None = None


@dataclass(frozen=True)
class TaskReach:
    """Where the tunnel may reach a running task (tunnel.py): its address, and for a
    process task the processes whose listening ports are its own (None: a container,
    every port of its address is its own); what an exec in it runs with."""

    task_id: int
    address: str
    pids: frozenset[int] | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: tuple[int, int, tuple[int, ...]] | None = None  # (uid, gid, groups) of a process task's user
    container: str | None = None  # the container's id, for an exec in it


class Runtime(abc.ABC):
    kind: str  # "docker" or "process": what the node reports as exec_mode

    @abc.abstractmethod
    def available(self) -> tuple[bool, str]:
        """(usable now, why not)."""

    @abc.abstractmethod
    def ensure_image(self, image: str, credentials: dict | None = None) -> None:
        """Make the image present (no-op for the process runtime). Raises RuntimeError_."""

    @abc.abstractmethod
    def start(self, spec: TaskSpec) -> None:
        """Start the task under spec.name. Raises RuntimeError_ (nothing left running)."""

    @abc.abstractmethod
    def state(self, task_id: int) -> TaskState | None:
        """The task's state, or None when this runtime holds no such task."""

    @abc.abstractmethod
    def stop(self, task_id: int, grace_seconds: float = 10.0) -> None:
        """Ask it to stop (SIGTERM), kill it after the grace period. Idempotent."""

    @abc.abstractmethod
    def logs_tail(self, task_id: int, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of its output (stdout and stderr), "" when there is none."""

    @abc.abstractmethod
    def read_output(self, task_id: int, cursor: dict | None, limit: int = OUTPUT_READ_BYTES) -> OutputRead:
        """The task's output lines after `cursor` (None: from its start), about `limit`
        bytes at most, and the cursor that follows them (a dict the caller keeps as it is,
        on disk too, to go on after an agent restart). A line still being written (no
        newline yet) waits for the next read, unless it is already MAX_LINE_BYTES long or
        the task has ended. Nothing new, or no such task: no lines and the same cursor."""

    @abc.abstractmethod
    def remove(self, task_id: int) -> None:
        """Forget the task and free what it used (after its outcome was delivered)."""

    @abc.abstractmethod
    def tasks(self) -> dict[int, TaskState]:
        """Every task this runtime holds, running or finished, by task id, including
        those started by an earlier agent process."""

    def reach(self, task_id: int) -> TaskReach | None:
        """Where the tunnel may reach the task while it runs; None when it does not run
        here (or this runtime offers no way in)."""
        return None
