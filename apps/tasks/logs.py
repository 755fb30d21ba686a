"""Live task logs: the lines an agent reads from a running task's stdout and stderr, stored
as they arrive and fed to followers (docs/api.md#live-logs).

The agent numbers each run's lines from 0 (`run` names the run: a requeued task runs
again, elsewhere, under another run) and resends a batch until it is answered, so the
store takes each line once: a task's state row says which run writes now and that run's
next line; lines below it are resends and skipped. A task's lines are numbered from 1 (0:
none yet, where a reader starts `after`); a new run continues the numbering (`base`), so a
task's sequence numbers only grow, over every run.

Writes, one ingestion at a time per batch: the batch's state rows are locked in task id
order (the only lock order for `task_log_state`; the trim job locks one row), the new
lines are inserted, the rows updated, in one transaction. The lines table is partitioned
by the day they arrived (the server's clock) and retention drops whole days; a task's
lines past HETEROFLOW_TASK_LOG_MAX_BYTES are trimmed oldest first by a job the ingestion
asks for once a task is a quarter over.

Followers are fed through Redis pub/sub (one channel per task), so any web process serves
any follower; a follower also reads the table after the last line it sent, so a message
Redis lost (or Redis away) delays lines, never loses them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import orjson
from django.conf import settings
from django.db import connection, transaction

from apps.core.clock import utcnow
from apps.core.partitions import DailyTable
from apps.core.redis import client as redis_client

logger = logging.getLogger(__name__)

TASK_LOG_LINES = DailyTable("task_log_lines", "received_at")
STREAMS = ("stdout", "stderr", "system")  # stored as their index
STREAM_CODES = {name: code for code, name in enumerate(STREAMS)}
MAX_LINE_CHARS = 16_384  # a longer line is cut (the agent splits long lines before this)
MAX_PAGE = 10_000
DEFAULT_PAGE = 1_000
TRIM_SLACK = 1.25  # a task this far over its bound is trimmed back to it


def channel(task_id: int) -> str:
    """A task's pub/sub channel. Redis channels are one namespace for every database of
    a server, so the name carries the deployment's database: two deployments (or test
    runs) sharing a Redis server never hear each other's tasks."""
    return f"heteroflow:{settings.DATABASES['default']['NAME']}:task-logs:{task_id}"


def clean_text(text: str) -> str:
    """What PostgreSQL's text takes: no NUL; at most MAX_LINE_CHARS."""
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    return text[:MAX_LINE_CHARS]


# --- ingestion (the agent's batches; apps.tasks.api.log_route) ---------------------------


@dataclass
class RunBatch:
    """One task's lines in an agent's batch: (n, at, stream, text), n the run's numbering."""

    task_id: int
    run: str
    lines: list[tuple[int, float, int, str]]  # at: seconds since the epoch
    dropped_bytes: int = 0


@dataclass
class Ingested:
    next_by_task: dict[int, int] = field(default_factory=dict)  # the run's next line, for the agent
    refused: list[int] = field(default_factory=list)  # not this node's tasks: the agent stops sending
    published: dict[int, list[dict]] = field(default_factory=dict)  # task id -> lines stored now
    over_bound: list[int] = field(default_factory=list)  # tasks to trim


# A state row for each of the node's tasks in the batch (a task on another node, or none,
# gets none and is refused), then those rows locked in task id order.
CLAIM_STATES = """
    INSERT INTO task_log_state (task_id, run, base, run_next, next_seq, first_seq, stored_bytes, dropped_bytes,
                                updated_at)
    SELECT t.id, '', 1, 0, 1, 1, 0, 0, %(now)s FROM tasks AS t
    WHERE t.id = ANY(%(ids)s) AND t.node_id = %(node)s ORDER BY t.id
    ON CONFLICT (task_id) DO NOTHING
"""
LOCK_STATES = """
    SELECT s.task_id, s.run, s.base, s.run_next, s.next_seq, s.stored_bytes
    FROM task_log_state AS s JOIN tasks AS t ON t.id = s.task_id
    WHERE s.task_id = ANY(%(ids)s) AND t.node_id = %(node)s ORDER BY s.task_id FOR UPDATE OF s
"""
# The lines as one JSON parameter, unpacked by PostgreSQL: adapting them as five arrays
# cost the web process more than all the rest of a batch (make bench-logs).
INSERT_LINES = """
    INSERT INTO task_log_lines (task_id, seq, at, received_at, stream, text)
    SELECT l.t, l.s, to_timestamp(l.a), %(now)s, l.k, l.x
    FROM json_to_recordset(%(lines)s::json) AS l(t bigint, s bigint, a float8, k smallint, x text)
"""
UPDATE_STATES = """
    UPDATE task_log_state AS s SET run = v.run, base = v.base, run_next = v.run_next, next_seq = v.next_seq,
        stored_bytes = s.stored_bytes + v.bytes, dropped_bytes = s.dropped_bytes + v.dropped, updated_at = %(now)s
    FROM unnest(%(task_ids)s::bigint[], %(runs)s::text[], %(bases)s::bigint[], %(run_nexts)s::bigint[],
                %(next_seqs)s::bigint[], %(bytes)s::bigint[], %(dropped)s::bigint[])
         AS v(task_id, run, base, run_next, next_seq, bytes, dropped)
    WHERE s.task_id = v.task_id
    RETURNING s.task_id, s.stored_bytes
"""


async def ingest(conn, node_id: str, batches: list[RunBatch], now: datetime) -> Ingested:
    """Store an agent's batch in one transaction (`conn` in autocommit mode). Lines the
    store has (a resend) are skipped; a task that is not this node's is refused whole."""
    out = Ingested()
    ids = sorted({batch.task_id for batch in batches})
    if not ids:
        return out
    rows = {task_id: None for task_id in ids}
    lines: list[dict] = []
    states: dict[str, list] = {key: [] for key in ("task_ids", "runs", "bases", "run_nexts", "next_seqs", "bytes")}
    states["dropped"] = []
    async with conn.transaction():
        cur = conn.cursor()
        await cur.execute(CLAIM_STATES, {"ids": ids, "node": node_id, "now": now})
        await cur.execute(LOCK_STATES, {"ids": ids, "node": node_id})
        for task_id, run, base, run_next, next_seq, stored in await cur.fetchall():
            rows[task_id] = [run, base, run_next, next_seq, stored]
        for batch in batches:  # in the agent's order: a task's batches follow each other
            row = rows[batch.task_id]
            if row is None:
                if batch.task_id not in out.refused:
                    out.refused.append(batch.task_id)
                continue
            run, base, run_next, next_seq, _ = row
            if batch.run != run:  # a new run continues the task's numbering
                run, base, run_next = batch.run, next_seq, 0
            added = 0
            stored_lines = out.published.setdefault(batch.task_id, [])
            for n, at, stream, text in batch.lines:
                if n < run_next:
                    continue  # a resend
                seq = base + n
                lines.append({"t": batch.task_id, "s": seq, "a": at, "k": stream, "x": text})
                added += len(text.encode())
                run_next = n + 1
                stored_lines.append({"seq": seq, "at": at, "stream": STREAMS[stream], "text": text})
            row[:4] = [run, base, run_next, max(next_seq, base + run_next)]
            row.append((added, batch.dropped_bytes))
        for task_id, row in rows.items():
            if row is None:
                continue
            run, base, run_next, next_seq, _stored, *counts = row
            states["task_ids"].append(task_id)
            states["runs"].append(run)
            states["bases"].append(base)
            states["run_nexts"].append(run_next)
            states["next_seqs"].append(next_seq)
            states["bytes"].append(sum(added for added, _ in counts))
            states["dropped"].append(sum(dropped for _, dropped in counts))
            out.next_by_task[task_id] = run_next
        if lines:
            await cur.execute(INSERT_LINES, {"lines": orjson.dumps(lines).decode(), "now": now})
        await cur.execute(UPDATE_STATES, states | {"now": now})
        bound = settings.HETEROFLOW_TASK_LOG_MAX_BYTES * TRIM_SLACK
        out.over_bound = [task_id for task_id, stored in await cur.fetchall() if stored > bound]
    out.published = {task_id: stored for task_id, stored in out.published.items() if stored}
    return out


def publication(lines: list[dict]) -> bytes:
    """Stored lines for the followers, `at` (seconds since the epoch here) as the API's time."""
    return orjson.dumps({"lines": [line | {"at": iso_time(line["at"])} for line in lines]})


def iso_time(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def ended_publication(status: str) -> bytes:
    return orjson.dumps({"status": status})


# --- reading ----------------------------------------------------------------------------

# A page of one task's lines after `after` (the last one a reader has), optionally since a
# time; a tail: the last N, in order. Both carry the task's status and exit code, so a
# reader learns in the same round trip whether more can come.
PAGE = """
    SELECT l.seq, l.at, l.stream, l.text FROM task_log_lines AS l
    WHERE l.task_id = %(task)s AND l.seq > %(after)s AND (%(since)s::timestamptz IS NULL OR l.at >= %(since)s)
    ORDER BY l.seq LIMIT %(limit)s
"""
TAIL = f"SELECT * FROM ({PAGE.replace('ORDER BY l.seq', 'ORDER BY l.seq DESC')}) AS t ORDER BY seq"


def line_dict(seq: int, at: datetime, stream: int, text: str) -> dict:
    return {"seq": seq, "at": at, "stream": STREAMS[stream], "text": text}


def page_params(task_id: int, *, after: int = 0, since: datetime | None = None, limit: int = DEFAULT_PAGE) -> dict:
    return {"task": task_id, "after": after, "since": since, "limit": max(1, min(limit, MAX_PAGE))}


def read_page(
    task_id: int, *, after: int = 0, tail: int | None = None, since: datetime | None = None, limit: int = DEFAULT_PAGE
) -> list[dict]:
    """Lines of one task: after `after`, or the last `tail` (of those after `after`)."""
    params = page_params(task_id, after=after, since=since, limit=tail if tail is not None else limit)
    with connection.cursor() as cursor:
        cursor.execute(TAIL if tail is not None else PAGE, params)
        return [line_dict(*row) for row in cursor.fetchall()]


async def read_page_async(conn, task_id: int, *, after: int, limit: int = DEFAULT_PAGE) -> list[dict]:
    cur = conn.cursor()
    await cur.execute(PAGE, page_params(task_id, after=after, limit=limit))
    return [line_dict(*row) for row in await cur.fetchall()]


# --- the end of a run, for followers (apps.tasks.services._move_tasks) ---------------------


def announce_moves(task_ids, status: str) -> None:
    """After the transaction commits: tell each task's followers that its run ended and
    in which status (a follower ends on a terminal one, and keeps following a requeued
    task). Redis away is logged: followers also look at the task every few seconds."""
    ids = list(task_ids)

    def publish():
        try:
            redis = redis_client()
            payload = ended_publication(status)
            with redis.pipeline(transaction=False) as pipe:
                for task_id in ids:
                    pipe.publish(channel(task_id), payload)
                pipe.execute()
        except Exception as exc:  # noqa: BLE001  (followers find the end by looking)
            logger.warning(
                "could not tell the log followers of %d tasks that they moved to %s: %s", len(ids), status, exc
            )

    transaction.on_commit(publish)


# --- bounds -------------------------------------------------------------------------------

TRIM = """
    WITH kept AS (
        SELECT seq, sum(octet_length(text)) OVER (ORDER BY seq DESC) AS from_end
        FROM task_log_lines WHERE task_id = %(task)s
    ), cut AS (
        SELECT COALESCE(min(seq), %(next)s) AS first, COALESCE(max(from_end), 0) AS bytes
        FROM kept WHERE from_end <= %(bound)s
    ), gone AS (
        DELETE FROM task_log_lines WHERE task_id = %(task)s AND seq < (SELECT first FROM cut)
    )
    UPDATE task_log_state SET first_seq = (SELECT first FROM cut), stored_bytes = (SELECT bytes FROM cut)
    WHERE task_id = %(task)s
"""


def trim(task_id: int) -> bool:
    """Trim a task's lines to its bound, the oldest first. Under the state row's lock, so
    the ingestion's next batch waits for it (one row: no order to keep)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT next_seq, stored_bytes FROM task_log_state WHERE task_id = %s FOR UPDATE", [task_id])
        row = cursor.fetchone()
        if row is None or row[1] <= settings.HETEROFLOW_TASK_LOG_MAX_BYTES:
            return False
        cursor.execute(TRIM, {"task": task_id, "next": row[0], "bound": settings.HETEROFLOW_TASK_LOG_MAX_BYTES})
    return True


def prune_and_prepare_partitions(now: datetime | None = None) -> dict:
    now = now or utcnow()
    return TASK_LOG_LINES.prune_and_prepare(now, now - timedelta(days=settings.HETEROFLOW_TASK_LOG_RETENTION_DAYS))
