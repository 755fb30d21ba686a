"""Task and task-group logs: pages, and following them live.

The API (docs/api.md, the logs of a task):

- `GET …/logs?after=SEQ&tail=N&since=…` → `{"lines": [{"seq", "at", "stream", "text"}],
  "next", "status", "exit_code"}`; `next` is the `after` of the following page.
- `GET …/logs?follow=true&after=SEQ` → `text/event-stream`: `lines` (or unnamed) events
  with `id:` the seq of their last line and `data: {"lines": […]}`, an `end` event with
  `data: {"status", "exit_code"}` (a group's: `exit_codes` by rank), `: keepalive`
  comments.

A follower reconnects after a dropped stream with `Last-Event-ID` and `after=` the last
seq it has, so no line is lost or repeated (a line at or below what it has is dropped),
and while the server cannot be reached it retries with a growing pause: it outlives a
restart of the control plane.

A server from before the live logs answers `{"task_id", "status", "log_tail"}` (the
output the agent sent with the final report) whatever is asked; then the lines are
numbered 1, 2, … from that tail, and following means waiting for the task to end.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, Union

import httpx

from heteroflow_client.errors import ApiError, ConnectionFailed
from heteroflow_client.transport import Transport, api_error
from heteroflow_client.types import GROUP_TERMINAL, TERMINAL, LogEnd, LogLine

LogItem = Union[LogLine, LogEnd]
# server-sent events: a line ends with CRLF, LF or CR (a CR at a chunk's end may be half a CRLF)
LINE_END = re.compile(r"\r\n|\n|\r(?!$)")
# a stream whose server sent nothing for this long (keepalives come every 15 s) is dead
READ_TIMEOUT = 45.0
RETRY_STATUSES = frozenset({502, 503, 504})


@dataclass
class Event:
    type: str
    data: str
    id: str | None = None


class SSEParser:
    """An incremental parser of a `text/event-stream` body (the WHATWG rules): feed it the
    text as it arrives, get the complete events back."""

    def __init__(self) -> None:
        self.buffer = ""
        self.data: list[str] = []
        self.type = ""
        self.last_id: str | None = None
        self.retry_ms: int | None = None

    def feed(self, chunk: str) -> list[Event]:
        self.buffer += chunk
        parts = LINE_END.split(self.buffer)
        self.buffer = parts.pop()  # the unfinished line
        events = []
        for line in parts:
            event = self.line(line)
            if event is not None:
                events.append(event)
        return events

    def line(self, line: str) -> Event | None:
        if line == "":
            if not self.data:
                self.type = ""
                return None
            event = Event(self.type or "message", "\n".join(self.data), self.last_id)
            self.data, self.type = [], ""
            return event
        if line.startswith(":"):
            return None  # a comment: the keepalive
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self.data.append(value)
        elif name == "event":
            self.type = value
        elif name == "id" and "\0" not in value:
            self.last_id = value
        elif name == "retry" and value.isdigit():
            self.retry_ms = int(value)
        return None


class Backoff:
    def __init__(self, first: float = 0.5, most: float = 10.0, sleep: Callable[[float], None] = time.sleep):
        self.first, self.most, self.sleep = first, most, sleep
        self.delay = first

    def wait(self) -> None:
        self.sleep(self.delay)
        self.delay = min(self.delay * 2, self.most)

    def reset(self) -> None:
        self.delay = self.first


def _lines(payload: dict, task: int | None) -> list[LogLine]:
    return [LogLine.from_api(line, task) for line in payload.get("lines") or []]


def old_shape_lines(payload: dict, task: int | None) -> list[LogLine]:
    """The lines of a server's old answer (`log_tail`), numbered from 1."""
    tail = payload.get("log_tail") or ""
    return [LogLine(seq=i, text=text, task=task) for i, text in enumerate(tail.splitlines(), start=1)]


def ended_with_tail(payload: dict) -> bool:
    """An ended task whose live log holds nothing but whose final report carried output
    (an agent that does not send live lines): its tail is its log."""
    return payload.get("status") in TERMINAL and bool(payload.get("log_tail"))


@dataclass
class Page:
    lines: list[LogLine]
    next: int
    status: str
    exit_code: int | None
    live: bool  # the server has the live logs API (False: the old tail)


def read_page(
    transport: Transport,
    path: str,
    *,
    after: int | None = None,
    tail: int | None = None,
    since: str | None = None,
    rank: int | None = None,
    task: int | None = None,
) -> Page:
    payload = transport.get(path, after=after, tail=tail, since=since, rank=rank)
    if "lines" in payload and (payload["lines"] or after or not ended_with_tail(payload)):
        lines = _lines(payload, task)
        following = payload.get("next")
        if following is None:
            following = max([after or 0, *(line.seq for line in lines)])
        return Page(lines, int(following), payload.get("status", ""), payload.get("exit_code"), True)
    lines = old_shape_lines(payload, task)
    if after:
        lines = [line for line in lines if line.seq > after]
    if tail is not None:
        lines = lines[-tail:] if tail > 0 else []
    return Page(lines, len(old_shape_lines(payload, task)), payload.get("status", ""), None, False)


class Follower:
    """Follow one log (a task's, or a group's with `group=True`) to its end."""

    def __init__(
        self,
        transport: Transport,
        path: str,
        *,
        after: int = 0,
        rank: int | None = None,
        group: bool = False,
        task: int | None = None,
        backoff: Backoff | None = None,
        poll_interval: float = 2.0,
        on_status: Callable[[str], None] | None = None,
        on_retry: Callable[[str], None] | None = None,
    ):
        self.transport = transport
        self.path = path
        self.last = after  # the seq (the event id) everything up to which has been given
        self.rank = rank
        self.group = group
        self.task = task
        self.backoff = backoff or Backoff()
        self.poll_interval = poll_interval
        self.on_status = on_status or (lambda status: None)
        self.on_retry = on_retry or (lambda why: None)
        self.by_rank: dict = {}  # a group's lines: the last seq given per rank
        self.reconnects = 0

    def fresh(self, line: LogLine) -> bool:
        if self.group:
            key = line.rank
            if line.seq <= self.by_rank.get(key, 0):
                return False
            self.by_rank[key] = line.seq
            return True
        if line.seq <= self.last:
            return False
        self.last = line.seq
        return True

    def __iter__(self) -> Iterator[LogItem]:
        while True:
            try:
                response = self.transport.stream(
                    self.path,
                    params={"follow": "true", "after": self.last, "rank": self.rank},
                    headers={
                        "Accept": "text/event-stream, application/json",
                        **({"Last-Event-ID": str(self.last)} if self.last else {}),
                    },
                    timeout=httpx.Timeout(10.0, read=READ_TIMEOUT),
                )
            except ConnectionFailed as exc:
                self.on_retry(exc.cause)
                self.backoff.wait()
                continue
            try:
                if response.status_code in RETRY_STATUSES:
                    self.on_retry(f"the server answered {response.status_code}")
                    self.backoff.wait()
                    continue
                if response.status_code >= 400:
                    response.read()
                    raise api_error(response, "GET", self.path)
                if not response.headers.get("content-type", "").startswith("text/event-stream"):
                    response.read()
                    yield from self.poll(response.json())
                    return
                self.backoff.reset()
                end = yield from self.events(response)
                if end is not None:
                    yield end
                    return
            finally:
                response.close()
            self.reconnects += 1
            self.on_retry("the log stream was cut")
            self.backoff.wait()

    def events(self, response: httpx.Response):
        """The lines of one connection; the end when the server sent it, else None (cut)."""
        parser = SSEParser()
        try:
            for chunk in response.iter_text():
                for event in parser.feed(chunk):
                    if event.type in ("lines", "message"):
                        for line in _lines(json.loads(event.data), self.task):
                            if self.fresh(line):
                                yield line
                        if event.id and event.id.isdigit():
                            self.last = max(self.last, int(event.id))
                    elif event.type == "end":
                        data = json.loads(event.data) if event.data.strip() else {}
                        return LogEnd(
                            status=str(data.get("status", "")),
                            exit_code=data.get("exit_code"),
                            exit_codes={int(k): v for k, v in (data.get("exit_codes") or {}).items()},
                        )
        except (httpx.TransportError, httpx.StreamError):
            return None  # cut: the caller reconnects from self.last
        return None

    def poll(self, payload: dict) -> Iterator[LogItem]:
        """A server without the live stream: page until the task has ended."""
        terminal = GROUP_TERMINAL if self.group else TERMINAL
        status = None
        while True:
            page_status = payload.get("status", "")
            if page_status != status:
                status = page_status
                self.on_status(status)
            if "lines" in payload:
                for line in _lines(payload, self.task):
                    if self.fresh(line):
                        yield line
                if payload.get("next") is not None:
                    self.last = max(self.last, int(payload["next"]))
                more = bool(payload.get("lines"))
                if status in terminal and not more:
                    yield LogEnd(status=status, exit_code=payload.get("exit_code"))
                    return
            elif status in terminal:
                for line in old_shape_lines(payload, self.task):
                    if self.fresh(line):
                        yield line
                yield LogEnd(status=status, exit_code=None)
                return
            if "lines" not in payload or not payload.get("lines"):
                time.sleep(self.poll_interval)
            while True:
                try:
                    payload = self.transport.get(self.path, after=self.last or None, rank=self.rank)
                    self.backoff.reset()
                    break
                except ConnectionFailed as exc:
                    self.on_retry(exc.cause)
                    self.backoff.wait()
                except ApiError as exc:
                    if exc.status not in RETRY_STATUSES:
                        raise
                    self.backoff.wait()


def merge(followers: dict, on_error: Callable[[BaseException], None] | None = None) -> Iterator[LogItem]:
    """Interleave several followers (a group's members, by rank) as their lines come;
    each member's LogEnd is given as it comes too."""
    import queue

    items: queue.Queue = queue.Queue()
    done = object()

    def pump(rank, follower):
        try:
            for item in follower:
                if isinstance(item, LogLine):
                    item.rank = rank
                items.put((rank, item))
        except BaseException as exc:  # handed to the reader
            items.put((rank, exc))
        finally:
            items.put((rank, done))

    threads = [threading.Thread(target=pump, args=(rank, f), daemon=True) for rank, f in followers.items()]
    for thread in threads:
        thread.start()
    running = len(threads)
    while running:
        rank, item = items.get()
        if item is done:
            running -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield item
