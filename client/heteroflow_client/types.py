"""Typed results. Each keeps the API's whole object in `raw`; the attributes are the
fields most code reads. A field the server does not send is left at its default, so a
newer or older server never breaks a result."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

# A task's statuses after which nothing changes (the API's TERMINAL statuses).
TERMINAL = frozenset({"completed", "failed", "cancelled", "stopped"})
GROUP_TERMINAL = frozenset({"completed", "failed", "stopped"})

T = TypeVar("T", bound="Result")


@dataclass
class Result:
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_api(cls: type[T], data: dict) -> T:
        names = {f.name for f in dataclasses.fields(cls)} - {"raw"}
        return cls(raw=data, **{name: data[name] for name in names if name in data})

    def __getitem__(self, name: str) -> Any:
        """Any field of the API's object: `task["schedule_reason"]`."""
        return self.raw[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.raw.get(name, default)


@dataclass
class Task(Result):
    id: int = 0
    name: str = ""
    status: str = ""
    kind: str = ""
    tenant: str | None = None
    image: str = ""
    command: list = field(default_factory=list)
    node: str | None = None
    gpu_required: int = 0
    gpu_type: str = ""
    gpu_memory_mb: int | None = None
    priority: int = 50
    exit_code: int | None = None
    error_message: str = ""
    schedule_reason: dict = field(default_factory=dict)
    host_port: int | None = None
    created_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL


@dataclass
class TaskGroup(Result):
    id: int = 0
    name: str = ""
    status: str = ""
    tenant: str | None = None
    strategy: str = ""
    world_size: int = 0
    gpus_per_worker: int = 0
    gpu_type: str = ""
    image: str = ""
    attempts: int = 0
    schedule_reason: dict = field(default_factory=dict)
    network: dict = field(default_factory=dict)
    members: list = field(default_factory=list)
    created_at: str | None = None

    @property
    def ended(self) -> bool:
        return self.status in GROUP_TERMINAL


@dataclass
class Service(Result):
    id: int = 0
    name: str = ""
    tenant: str | None = None
    model: str = ""
    engine: str = ""
    gpu_type: str = ""
    gpus_per_replica: int = 1
    state: str = ""
    replicas: int = 0
    min_replicas: int = 1
    max_replicas: int = 1
    healthy_replicas: int | None = None
    lendable: bool = True  # idle replicas' cards may be lent to its tenant's training
    members: list = field(default_factory=list)
    created_at: str | None = None


@dataclass
class Node(Result):
    id: str = ""
    name: str = ""
    status: str = ""
    tenant: str | None = None
    gpu_type: str | None = None
    gpu_model: str | None = None
    gpu_count: int = 0
    gpu_used: int = 0
    gpus_lost: int = 0
    gpus: list = field(default_factory=list)
    exec_mode: str | None = None
    last_heartbeat_at: str | None = None


@dataclass
class Model(Result):
    id: int = 0
    name: str = ""
    tenant: str | None = None
    source_kind: str = ""
    source: str = ""
    format: str = ""
    engines: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    cached_on: list = field(default_factory=list)


@dataclass
class EndpointKey(Result):
    id: int = 0
    name: str = ""
    tenant: str | None = None
    display_prefix: str = ""
    allowed_models: list = field(default_factory=list)
    active: bool = True
    expires_at: str | None = None
    last_used_at: str | None = None
    revoked_at: str | None = None
    key: str | None = None  # only in the answer that creates it


@dataclass
class Me(Result):
    kind: str = ""
    username: str | None = None
    tenant: str | None = None
    role: str | None = None


@dataclass
class LogLine:
    """One line of a task's output. `seq` orders a task's lines (1, 2, …); `stream` is
    stdout, stderr or system; `rank` is the member's, in a task group's log."""

    seq: int
    text: str
    stream: str = "stdout"
    at: str | None = None
    rank: int | None = None
    task: int | None = None
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_api(cls, data: dict, task: int | None = None) -> LogLine:
        return cls(
            seq=int(data.get("seq", 0)),
            text=str(data.get("text", "")),
            stream=str(data.get("stream") or "stdout"),
            at=data.get("at"),
            rank=data.get("rank"),
            task=data.get("task", task),
            raw=data,
        )


@dataclass
class LogEnd:
    """How a followed log ended: the task's (or group's) final status and exit code(s)."""

    status: str
    exit_code: int | None = None
    exit_codes: dict = field(default_factory=dict)  # a group's, by rank
