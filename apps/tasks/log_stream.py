"""Following a task's (or a group's) live log: a `text/event-stream` of its lines as they
are stored, until it ends (docs/api.md#live-logs).

Each follower subscribes to its tasks' Redis channels (apps.tasks.logs.channel), then
reads the table after its last line, then sends what each message brings. A message
that does not continue what it sent (a gap: a message it missed, or one that came before
the read caught up) sends it back to the table; so does silence for
HETEROFLOW_LOG_FOLLOW_POLL_SECONDS (5 s), which also looks at the task's status. Redis away
therefore slows a follower to one read a period and loses nothing; a follower that
reconnects with Last-Event-ID (the last sequence number it got) goes on from there.

Events: `lines` (data `{"lines": [...]}`; id: the last line's sequence number, or for a
group its cursor `rank:seq,…`), `end` when the task is over (data `{"status",
"exit_code"}`; a group's: `{"status", "exit_codes": {rank: code}}`), and a `: keepalive`
comment every KEEPALIVE_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from django.conf import settings

from apps.core.db import LoopPool
from apps.core.redis import async_client
from apps.tasks import logs
from apps.tasks.choices import TERMINAL, group_status

logger = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 15.0
LOST = object()  # what _next_message answers when Redis went away

_pool = LoopPool(lambda: settings.HETEROFLOW_TASK_LOG_DB_POOL_SIZE, application_name="heteroflow-log-followers")


@dataclass
class Member:
    """One task a follower follows: its rank in the group (None for a lone task), the
    last sequence number sent."""

    task_id: int
    rank: int | None
    last: int = 0


def poll_seconds() -> float:
    return settings.HETEROFLOW_LOG_FOLLOW_POLL_SECONDS


def event(kind: str, data: dict, event_id: str | None = None) -> bytes:
    head = f"event: {kind}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return head.encode() + b"data: " + orjson.dumps(data) + b"\n\n"


def group_cursor(members: list[Member]) -> str:
    return ",".join(f"{member.rank}:{member.last}" for member in members)


def parse_group_cursor(value: str | None) -> dict[int, int]:
    """`rank:seq,…` (a group's event id) as {rank: seq}; anything unreadable is ignored."""
    cursor = {}
    for part in (value or "").split(","):
        rank, _, seq = part.partition(":")
        if rank.strip().isdigit() and seq.strip().isdigit():
            cursor[int(rank)] = int(seq)
    return cursor


TASK_STATUS = "SELECT status, exit_code FROM tasks WHERE id = %s"
GROUP_STATUS = """
    SELECT t.rank, t.status, t.exit_code FROM tasks AS t WHERE t.group_id = %s ORDER BY t.rank
"""


async def follow(members: list[Member], *, group_id: int | None = None) -> AsyncIterator[bytes]:
    """The event stream of `members` (one task, or a group's members in rank order)."""
    pool = await _pool.get()
    pubsub = None
    try:
        pubsub = async_client().pubsub(ignore_subscribe_messages=True)
        await asyncio.wait_for(pubsub.subscribe(*(logs.channel(m.task_id) for m in members)), 2.0)
    except Exception as exc:  # noqa: BLE001  (Redis away: follow by reading the table)
        logger.info("following without Redis (%s): the table is read every %s s", exc, poll_seconds())
        pubsub = await _close(pubsub)
    by_task = {member.task_id: member for member in members}
    yield b"retry: 2000\n\n"
    last_sent = time.monotonic()
    try:
        while True:
            async for chunk in _catch_up(pool, members, group_id):
                yield chunk
                last_sent = time.monotonic()
            ended = await _ended(pool, members, group_id)
            if ended is not None:
                async for chunk in _catch_up(pool, members, group_id):  # lines stored as it ended
                    yield chunk
                yield event("end", ended)
                return
            # wait for news: lines that continue ours are sent as they are; anything else
            # (a gap, a run's end, silence) goes back to the table
            deadline = time.monotonic() + poll_seconds()
            while (left := deadline - time.monotonic()) > 0:
                message = await _next_message(pubsub, min(left, KEEPALIVE_SECONDS))
                if message is LOST:
                    pubsub = await _close(pubsub)
                    break
                if message is None:
                    if pubsub is not None and time.monotonic() - last_sent >= KEEPALIVE_SECONDS:
                        yield b": keepalive\n\n"
                        last_sent = time.monotonic()
                    continue
                task_id = int(message["channel"].rsplit(b":", 1)[1])
                chunk = logs.published_chunk(message["data"])
                member = by_task.get(task_id)
                if chunk is None or member is None or chunk[0] + chunk[1][0][0] > member.last + 1:
                    break
                fresh = logs.chunk_lines(*chunk, after=member.last)
                if fresh:
                    yield _lines_event(member, fresh, members, group_id)
                    last_sent = time.monotonic()
            if pubsub is None and time.monotonic() - last_sent >= KEEPALIVE_SECONDS:
                yield b": keepalive\n\n"
                last_sent = time.monotonic()
    finally:
        await _close(pubsub)


def _lines_event(member: Member, lines: list[dict], members: list[Member], group_id: int | None) -> bytes:
    member.last = lines[-1]["seq"]
    if group_id is None:
        return event("lines", {"lines": [_jsonable(line) for line in lines]}, str(member.last))
    return event(
        "lines",
        {"lines": [_jsonable(line) | {"rank": member.rank} for line in lines]},
        group_cursor(members),
    )


def _jsonable(line: dict) -> dict:
    at = line["at"]
    return line if isinstance(at, str) else line | {"at": at.isoformat().replace("+00:00", "Z")}


async def _catch_up(pool, members: list[Member], group_id: int | None) -> AsyncIterator[bytes]:
    for member in members:
        while True:
            async with pool.connection() as conn:
                lines = await logs.read_page_async(conn, member.task_id, after=member.last)
            if not lines:
                break
            yield _lines_event(member, lines, members, group_id)
            if len(lines) < logs.DEFAULT_PAGE:
                break


async def _ended(pool, members: list[Member], group_id: int | None) -> dict | None:
    """The end event's data once the task (the group) is over, else None."""
    async with pool.connection() as conn:
        cur = conn.cursor()
        if group_id is None:
            await cur.execute(TASK_STATUS, [members[0].task_id])
            row = await cur.fetchone()
            if row is None:
                return {"status": "deleted", "exit_code": None}
            return {"status": row[0], "exit_code": row[1]} if row[0] in TERMINAL else None
        await cur.execute(GROUP_STATUS, [group_id])
        ranks = await cur.fetchall()
    statuses = [status for _, status, _ in ranks]
    if not ranks or not all(status in TERMINAL for status in statuses):
        return None  # a group whose members are gone was deleted: its view answers 404 next
    return {"status": group_status(statuses), "exit_codes": {str(rank): code for rank, _, code in ranks}}


async def _next_message(pubsub, timeout: float):
    if pubsub is None:
        await asyncio.sleep(timeout)
        return None
    try:
        return await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
    except Exception as exc:  # noqa: BLE001  (Redis went away: read the table from now on)
        logger.info("a log follower lost Redis (%s): it reads the table every %s s", exc, poll_seconds())
        return LOST


async def _close(pubsub) -> None:
    if pubsub is not None:
        try:
            await pubsub.aclose()
        except Exception as exc:  # noqa: BLE001  (closing a connection that is gone)
            logger.debug("a follower's pub/sub connection did not close cleanly: %s", exc)
    return None
