"""The SDK: `Client` and its namespaces over the HeteroFlow API (docs/sdk.md)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from heteroflow_client import config
from heteroflow_client.errors import ApiError, HeteroFlowError, NotFound, ValidationError
from heteroflow_client.logs import Follower, LogItem, merge, read_page
from heteroflow_client.transport import Transport
from heteroflow_client.types import (
    EndpointKey,
    LogEnd,
    LogLine,
    Me,
    Model,
    Node,
    Result,
    Service,
    Task,
    TaskGroup,
)

if TYPE_CHECKING:  # pragma: no cover
    from heteroflow_client import jobfiles

TaskRef = Union[int, str, Task]
GroupRef = Union[int, str, TaskGroup]
COMMAND_LINE = "<command line>"


def task_id(task: TaskRef) -> int:
    if isinstance(task, Result):
        return int(task.id)  # type: ignore[attr-defined]
    text = str(task).strip()
    if not text.isdigit():
        raise HeteroFlowError(f"not a task id: {task!r}")
    return int(text)


group_id = task_id


class LogStream:
    """The lines of a log, as an iterator of LogLine. Once it is exhausted, `end` holds
    how the task (or group) ended (None when not following, or when the stream was left
    early)."""

    def __init__(self, items: Iterator[LogItem]):
        self._items = items
        self.end: LogEnd | None = None
        self.ends: list[tuple[int | None, LogEnd]] = []  # a merged group's members' ends

    def __iter__(self) -> Iterator[LogLine]:
        for item in self._items:
            if isinstance(item, LogEnd):
                self.end = item
            else:
                yield item

    def close(self) -> None:
        close = getattr(self._items, "close", None)
        if close:
            close()


class Namespace:
    def __init__(self, client: Client):
        self.client = client
        self.http = client.http


class Tasks(Namespace):
    def list(self, *, status: str | None = None, all: bool = False, limit: int = 50) -> list[Task]:
        """The newest `limit` tasks: active ones, or all with `all=True`, or those in
        `status`; newest first (one request: GET /tasks?ordering=newest)."""
        ask: dict = {"ordering": "newest", "limit": limit}
        if status:
            ask["status"] = status
        elif not all:
            ask["active"] = "true"
        return [Task.from_api(row) for row in self.http.get("tasks", **ask).get("results", [])]

    def get(self, task: TaskRef) -> Task:
        return Task.from_api(self.http.get(f"tasks/{task_id(task)}"))

    def stop(self, task: TaskRef) -> Task:
        return Task.from_api(self.http.post(f"tasks/{task_id(task)}/stop"))

    def create(self, payload: dict) -> Task:
        return Task.from_api(self.http.post("tasks", payload))

    def explain(self, task: TaskRef) -> dict:
        return self.http.get(f"tasks/{task_id(task)}/explain")

    def resubmit(self, task: TaskRef, change: dict) -> Task:
        """Queue a waiting task again with `change` (one of explain's suggestions) and
        cancel it: the new task."""
        return Task.from_api(self.http.post(f"tasks/{task_id(task)}/resubmit", {"change": change}))

    def events(self, task: TaskRef) -> list[dict]:
        return self.http.get(f"tasks/{task_id(task)}/events")

    def app(self, task: TaskRef) -> dict:
        """An interactive task's app (GET /tasks/{id}/app): {"app", "port", "path",
        "token"}; port, path and token are None for a shell."""
        return self.http.get(f"tasks/{task_id(task)}/app")

    def metrics(self, task: TaskRef, window: str = "5m") -> dict:
        """GET /tasks/{id}/metrics: the task's cards' samples (NotFound where the server
        has no such endpoint)."""
        return self.http.get(f"tasks/{task_id(task)}/metrics", window=window)

    def logs(
        self,
        task: TaskRef,
        follow: bool = True,
        *,
        after: int = 0,
        tail: int | None = None,
        since: str | None = None,
        on_status=None,
        on_retry=None,
    ) -> LogStream:
        """The task's log lines. Without `follow`, what there is now (the last `tail`
        lines, those since `since`: an ISO 8601 time or a duration such as 10m); with
        it, those and then every line as it comes, until the task ends (`.end`)."""
        ident = task_id(task)
        path = f"tasks/{ident}/logs"
        return LogStream(self._lines(path, ident, follow, after, tail, since, None, False, on_status, on_retry))

    def _lines(self, path, ident, follow, after, tail, since, rank, group, on_status, on_retry):
        if not follow or tail is not None or since is not None:
            page = read_page(self.http, path, after=after or None, tail=tail, since=since, rank=rank, task=ident)
            yield from page.lines
            if not follow:
                return
            after = page.next
        given = after
        for item in Follower(
            self.http,
            path,
            after=after,
            rank=rank,
            group=group,
            task=ident,
            on_status=on_status,
            on_retry=on_retry,
        ):
            if isinstance(item, LogEnd) and not given and not group:
                # nothing came live: an agent that sends only the final report's tail
                try:
                    yield from read_page(self.http, path, task=ident).lines
                except (ValueError, HeteroFlowError):
                    pass  # best effort: the end is what matters now
            elif isinstance(item, LogLine):
                given = given or item.seq
            yield item


class Groups(Namespace):
    def create(self, payload: dict) -> TaskGroup:
        return TaskGroup.from_api(self.http.post("task-groups", payload))

    def get(self, group: GroupRef) -> TaskGroup:
        return TaskGroup.from_api(self.http.get(f"task-groups/{group_id(group)}"))

    def list(self, *, status: str | None = None, limit: int = 50) -> list[TaskGroup]:
        page = self.http.get("task-groups", status=status, limit=limit)
        return [TaskGroup.from_api(row) for row in page.get("results", [])]

    def stop(self, group: GroupRef) -> TaskGroup:
        return TaskGroup.from_api(self.http.post(f"task-groups/{group_id(group)}/stop"))

    def explain(self, group: GroupRef) -> dict:
        return self.http.get(f"task-groups/{group_id(group)}/explain")

    def logs(
        self,
        group: GroupRef,
        follow: bool = True,
        *,
        rank: int | None = None,
        tail: int | None = None,
        since: str | None = None,
        on_status=None,
        on_retry=None,
    ) -> LogStream:
        """Every rank's lines (each LogLine has its `rank`), or one rank's. A server
        without the group log endpoint: each member's task log, interleaved."""
        ident = group_id(group)
        path = f"task-groups/{ident}/logs"
        detail = self.get(ident)  # 404 for a group that is not there
        tasks = self.client.tasks
        try:
            self.http.send("GET", f"/api/v1/{path}", params={"tail": 1, "rank": rank})
        except NotFound:
            members = {m["rank"]: m["id"] for m in detail.members if rank is None or m["rank"] == rank}
            if not members:
                raise HeteroFlowError(f"task group {ident} has no rank {rank}") from None
            followers = {
                r: tasks._lines(f"tasks/{t}/logs", t, follow, 0, tail, since, None, False, None, on_retry)
                for r, t in sorted(members.items())
            }
            stream = LogStream(self._merged(followers, follow, ident))
            return stream
        items = tasks._lines(path, None, follow, 0, tail, since, rank, True, on_status, on_retry)
        return LogStream(self._with_tails(items, ident, rank))

    def _with_tails(self, items, ident: int, rank: int | None):
        """The group's live lines; when it ended with none (an agent that sends only the
        final report's tail), each member's tail, by rank."""
        given = False
        for item in items:
            if isinstance(item, LogEnd) and not given:
                for member in sorted(self.get(ident).members, key=lambda m: m["rank"]):
                    if rank is not None and member["rank"] != rank:
                        continue
                    try:
                        page = read_page(self.http, f"tasks/{member['id']}/logs", task=member["id"])
                    except (ValueError, HeteroFlowError):
                        continue
                    for line in page.lines:
                        line.rank = member["rank"]
                        yield line
            given = given or isinstance(item, LogLine)
            yield item

    def _merged(self, followers: dict, follow: bool, ident: int):
        for item in merge(followers):
            if isinstance(item, LogEnd):
                continue  # a member's end; the group's is below
            yield item
        if follow:
            detail = self.get(ident)
            codes = {m["rank"]: m.get("exit_code") for m in detail.members}
            yield LogEnd(status=detail.status, exit_codes=codes)


class Services(Namespace):
    def create(self, payload: dict) -> Service:
        return Service.from_api(self.http.post("inference-services", payload))

    def list(self, *, state: str | None = None, model: str | None = None) -> list[Service]:
        return [Service.from_api(row) for row in self.http.pages("inference-services", state=state, model=model)]

    def get(self, service: int | str | Service) -> Service:
        return Service.from_api(self.http.get(f"inference-services/{self.resolve(service)}"))

    def resolve(self, service: int | str | Service) -> int:
        """A service's id from its id or its name."""
        if isinstance(service, Service):
            return service.id
        text = str(service)
        if text.isdigit():
            return int(text)
        for row in self.http.pages("inference-services"):
            if row.get("name") == text and row.get("state") != "stopped":
                return int(row["id"])
        raise NotFound(404, "not_found", f"No inference service named {text!r}.")

    def scale(self, service: int | str | Service, replicas: int) -> Service:
        ident = self.resolve(service)
        return Service.from_api(self.http.post(f"inference-services/{ident}/scale", {"replicas": replicas}))

    def stop(self, service: int | str | Service) -> Service:
        return Service.from_api(self.http.post(f"inference-services/{self.resolve(service)}/stop"))


class Models(Namespace):
    def list(self) -> list[Model]:
        return [Model.from_api(row) for row in self.http.pages("models")]


class Nodes(Namespace):
    def list(self, *, status: str | None = None, gpu_type: str | None = None) -> list[Node]:
        return [Node.from_api(row) for row in self.http.pages("nodes", status=status, gpu_type=gpu_type)]

    def get(self, node: str) -> Node:
        return Node.from_api(self.http.get(f"nodes/{node}"))


class Keys(Namespace):
    """Endpoint keys (sk-hf-) for the OpenAI-compatible endpoints (/v1/*)."""

    def list(self) -> list[EndpointKey]:
        return [EndpointKey.from_api(row) for row in self.http.pages("gateway/keys")]

    def create(self, name: str, **fields: Any) -> EndpointKey:
        body = {"name": name, **{k: v for k, v in fields.items() if v is not None}}
        return EndpointKey.from_api(self.http.post("gateway/keys", body))

    def revoke(self, key: int | str) -> None:
        self.http.delete(f"gateway/keys/{task_id(key)}")


class Simulations(Namespace):
    """Replays under other policies (operators; docs/simulate.md on the server)."""

    def create(self, request: dict) -> dict:
        return self.http.post("admin/simulations", request)

    def get(self, simulation: int) -> dict:
        return self.http.get(f"admin/simulations/{simulation}")

    def chart(self, url: str) -> bytes:
        """A finished replay's chart (a URL its `charts` lists), as PNG bytes."""
        return self.http.send("GET", url).content


class Client:
    """A connection to one HeteroFlow control plane.

    `url`, `key` and `profile` default to the environment (HETEROFLOW_URL,
    HETEROFLOW_API_KEY, HETEROFLOW_PROFILE) and then to `hf login`'s config file."""

    def __init__(
        self,
        url: str | None = None,
        key: str | None = None,
        profile: str | None = None,
        *,
        timeout: float = 30.0,
        debug: bool = False,
        transport=None,
    ):
        settings = config.resolve(url=url, key=key, profile=profile).require()
        self.url = settings.url.rstrip("/")  # type: ignore[union-attr]
        self.profile = settings.profile
        self.http = Transport(self.url, settings.key, timeout=timeout, debug=debug, transport=transport)
        self.tasks = Tasks(self)
        self.groups = Groups(self)
        self.services = Services(self)
        self.models = Models(self)
        self.nodes = Nodes(self)
        self.keys = Keys(self)
        self.simulations = Simulations(self)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def me(self) -> Me:
        return Me.from_api(self.http.get("me"))

    # --- job files and tasks ---------------------------------------------------------------

    def validate(self, path: str) -> list[jobfiles.Document]:
        """The documents of a job file, each checked against the server's schema;
        ValidationError (with every problem) otherwise."""
        from heteroflow_client import jobfiles

        return jobfiles.validated(jobfiles.load(path), self.http)

    def apply(self, path: str) -> list[Result]:
        """Create what a job file describes (every document checked first: one problem
        and nothing is sent). A task with `array` is created as an array (its tasks'
        ids in the result's `raw["ids"]`)."""
        return [self.submit(document) for document in self.validate(path)]

    def submit(self, document: jobfiles.Document) -> Result:
        answer = self.http.post(document.endpoint, document.payload())
        cls = {"task": Task, "group": TaskGroup, "service": Service}[document.kind or ""]
        if document.endpoint == "tasks/batch":
            return Task(raw=answer, id=answer["ids"][0] if answer.get("ids") else 0, status="pending")
        return cls.from_api(answer)

    def run(
        self,
        command: list | None = None,
        *,
        name: str | None = None,
        image: str | None = None,
        gpus: int | None = None,
        gpu_type: str | None = None,
        gpu_memory_mb: int | None = None,
        env: dict | None = None,
        file: str | None = None,
        **fields: Any,
    ) -> Task:
        """Queue one task: the job file's task (if `file`), with the arguments over it.
        Checked against the server's schema before it is sent."""
        from heteroflow_client import jobfiles

        document = self.task_document(
            command,
            name=name,
            image=image,
            gpus=gpus,
            gpu_type=gpu_type,
            gpu_memory_mb=gpu_memory_mb,
            env=env,
            file=file,
            **fields,
        )
        jobfiles.validated([document], self.http)
        task = self.submit(document)
        assert isinstance(task, Task)
        return task

    def task_document(self, command=None, *, file=None, env=None, **options: Any) -> jobfiles.Document:
        from heteroflow_client import jobfiles

        if file:
            documents = jobfiles.load(file)
            if len(documents) != 1 or documents[0].kind != "task":
                raise ValidationError(file, None, None, None, "hf run takes a file with one `kind: task` document")
            document = documents[0]
        else:
            document = jobfiles.Document(COMMAND_LINE, 0, {"kind": "task"})
        data = dict(document.data)
        flags = {
            "name": options.pop("name", None),
            "image": options.pop("image", None),
            "gpu_required": options.pop("gpus", None),
            "gpu_type": options.pop("gpu_type", None),
            "gpu_memory_mb": options.pop("gpu_memory_mb", None),
            **options,
        }
        data.update({key: value for key, value in flags.items() if value is not None})
        if command:
            data["command"] = list(command)
        if env:
            data["env"] = {**(data.get("env") or {}), **env}
        if not data.get("name"):
            data["name"] = default_name(data.get("command") or [])
        document.data = data
        return document

    def wait(self, task: TaskRef, timeout: float | None = None, *, interval: float = 2.0) -> Task:
        """The task once it has ended; TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            current = self.tasks.get(task)
            if current.ended:
                return current
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"task {current.id} is still {current.status} after {timeout} s")
            time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))

    def logs(self, task: TaskRef, follow: bool = True, **options: Any) -> LogStream:
        return self.tasks.logs(task, follow, **options)

    def explain(self, task: TaskRef) -> dict:
        return self.tasks.explain(task)

    def usage(self, **filters: Any) -> dict:
        """The endpoint keys' usage (GET /gateway/usage: buckets and `totals`) and the
        tasks' (GET /tasks/stats)."""
        gateway = self.http.get("gateway/usage", **{k: v for k, v in filters.items() if v is not None})
        return {"tasks": self.http.get("tasks/stats"), "gateway": gateway}


def default_name(command: list) -> str:
    first = Path(str(command[0])).name if command else "task"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", first).strip("-")
    return (name or "task")[:200]


__all__ = ["Client", "LogStream", "ApiError"]
