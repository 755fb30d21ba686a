"""Live task logs: the lines an agent reads from a running task's stdout and stderr, stored
as they arrive and fed to followers (docs/api.md#live-logs).

The agent numbers each run's lines from 0 (`run` names the run: a requeued task runs
again, elsewhere, under another run) and resends a batch until it is answered, so the
store takes each line once: a task's state row says which run writes now and that run's
next line; lines below it are resends and skipped. A task's lines are numbered from 1 (0:
none yet, where a reader starts `after`); a new run continues the numbering (`base`), so a
task's sequence numbers only grow, over every run.

Storage: each task's lines of one batch are one row of `task_log_chunks` (a chunk), their
text as the agent sent it, one JSON array of `[n, at, stream, text]` (seq = the chunk's
`base` + n). Stored a line a row, every line cost the web process a dict, an encode and a
JSON round trip and PostgreSQL a tuple and an index entry: a chunk costs the web process
a slice and one `orjson.dumps` per task, PostgreSQL one row, its text compressed (lz4
where the server has it). Readers unpack chunks in SQL (`json_array_elements`); a page
reads only the chunks past its start (`(task_id, last_seq)`).

Writes, one ingestion at a time per batch: the batch's state rows are locked in task id
order (the only lock order for `task_log_state`; the trim job locks one row), the new
chunks are inserted, the rows updated, in one transaction. The chunks table is
partitioned by the day they arrived (the server's clock) and retention drops whole days;
a task's chunks past HETEROFLOW_TASK_LOG_MAX_BYTES (counted as stored: the chunks' JSON
text) are trimmed oldest first, a chunk at a time, by a job the ingestion asks for once a
task is a quarter over.

Followers are fed through Redis pub/sub (one channel per task), so any web process serves
any follower; a follower also reads the table after the last line it sent, so a message
Redis lost (or Redis away) delays lines, never loses them.
"""

from __future__ import annotations

import bisect
import logging
import operator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import orjson
from django.conf import settings
from django.db import connection, transaction

from apps.core.clock import utcnow
from apps.core.partitions import DailyTable
from apps.core.redis import client as redis_client

logger = logging.getLogger(__name__)

TASK_LOG_CHUNKS = DailyTable("task_log_chunks", "received_at")
STREAMS = ("stdout", "stderr", "system")
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
    """One task's lines in an agent's batch, checked (apps.tasks.api.log_route): each
    `[n, at, stream, text]` as sent, n the run's numbering, rising; at in seconds since the
    epoch; text cleaned (clean_text)."""

    task_id: int
    run: str
    lines: list[list]
    dropped_bytes: int = 0


@dataclass
class Ingested:
    next_by_task: dict[int, int] = field(default_factory=dict)  # the run's next line, for the agent
    refused: list[int] = field(default_factory=list)  # not this node's tasks: the agent stops sending
    published: dict[int, list[bytes]] = field(default_factory=dict)  # task id -> its chunks stored now
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
# One row a chunk, in one pipelined round trip (executemany): each chunk's text travels as
# a parameter of its own, not escaped into an array literal.
INSERT_CHUNK = """
    INSERT INTO task_log_chunks (task_id, first_seq, last_seq, base, received_at, bytes, lines)
    VALUES (%s, %s, %s, %s, %s, %s, %s)
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
_N = operator.itemgetter(0)


@dataclass
class _State:
    """A task's state row while a batch is applied to it."""

    run: str
    base: int
    run_next: int
    next_seq: int
    added: int = 0
    dropped: int = 0


async def ingest(conn, node_id: str, batches: list[RunBatch], now: datetime) -> Ingested:
    """Store an agent's batch in one transaction (`conn` in autocommit mode). Lines the
    store has (a resend) are skipped; a task that is not this node's is refused whole."""
    out = Ingested()
    ids = sorted({batch.task_id for batch in batches})
    if not ids:
        return out
    states: dict[int, _State] = {}
    chunks: list[tuple] = []
    async with conn.transaction():
        cur = conn.cursor()
        await cur.execute(CLAIM_STATES, {"ids": ids, "node": node_id, "now": now})
        await cur.execute(LOCK_STATES, {"ids": ids, "node": node_id})
        for task_id, run, base, run_next, next_seq, _stored in await cur.fetchall():
            states[task_id] = _State(run, base, run_next, next_seq)
        for batch in batches:  # in the agent's order: a task's batches follow each other
            state = states.get(batch.task_id)
            if state is None:
                if batch.task_id not in out.refused:
                    out.refused.append(batch.task_id)
                continue
            state.dropped += batch.dropped_bytes
            if batch.run != state.run:  # a new run continues the task's numbering
                state.run, state.base, state.run_next = batch.run, state.next_seq, 0
            fresh = batch.lines[bisect.bisect_left(batch.lines, state.run_next, key=_N) :]  # past the resends
            if not fresh:
                continue
            text = orjson.dumps(fresh)
            chunks.append(
                (batch.task_id, state.base + fresh[0][0], state.base + fresh[-1][0], state.base, now, len(text),
                 text.decode())
            )  # fmt: skip
            out.published.setdefault(batch.task_id, []).append(b'{"base":%d,"lines":%b}' % (state.base, text))
            state.added += len(text)
            state.run_next = fresh[-1][0] + 1
            state.next_seq = max(state.next_seq, state.base + state.run_next)
        if chunks:
            await cur.executemany(INSERT_CHUNK, chunks)
        rows = [states[task_id] for task_id in sorted(states)]
        await cur.execute(
            UPDATE_STATES,
            {
                "task_ids": sorted(states),
                "runs": [row.run for row in rows],
                "bases": [row.base for row in rows],
                "run_nexts": [row.run_next for row in rows],
                "next_seqs": [row.next_seq for row in rows],
                "bytes": [row.added for row in rows],
                "dropped": [row.dropped for row in rows],
                "now": now,
            },
        )
        bound = settings.HETEROFLOW_TASK_LOG_MAX_BYTES * TRIM_SLACK
        out.over_bound = [task_id for task_id, stored in await cur.fetchall() if stored > bound]
    out.next_by_task = {task_id: state.run_next for task_id, state in sorted(states.items())}
    return out


def published_chunk(message: bytes) -> tuple[int, list[list]] | None:
    """A published chunk (`{"base", "lines": [[n, at, stream, text]…]}`): its base and
    lines; None for any other message (a run's end). A chunk is turned into the API's
    lines only by a follower (chunk_lines): a task nobody follows costs the ingestion no
    line of work."""
    payload = orjson.loads(message)
    if payload.get("base") is None or not payload.get("lines"):
        return None
    return payload["base"], payload["lines"]


def chunk_lines(base: int, chunk: list[list], *, after: int) -> list[dict]:
    """A chunk's lines past `after`, as the API writes them."""
    return [
        {"seq": base + n, "at": iso_time(at), "stream": stream, "text": text}
        for n, at, stream, text in chunk
        if base + n > after
    ]


def iso_time(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def ended_publication(status: str) -> bytes:
    return orjson.dumps({"status": status})


# --- reading ----------------------------------------------------------------------------

# A page of one task's lines after `after` (the last one a reader has), optionally since a
# time: the chunks past `after`, in order (the (task_id, last_seq) index), unpacked; a
# tail: the last N, in order. Both carry the task's status and exit code, so a reader
# learns in the same round trip whether more can come.
PAGE = """
    SELECT c.base + (e.line->>0)::bigint AS seq, to_timestamp((e.line->>1)::float8) AS at,
           e.line->>2 AS stream, e.line->>3 AS text
    FROM task_log_chunks AS c CROSS JOIN LATERAL json_array_elements(c.lines::json) WITH ORDINALITY AS e(line, o)
    WHERE c.task_id = %(task)s AND c.last_seq > %(after)s AND c.base + (e.line->>0)::bigint > %(after)s
      AND (%(since)s::timestamptz IS NULL OR to_timestamp((e.line->>1)::float8) >= %(since)s)
    ORDER BY c.last_seq, e.o LIMIT %(limit)s
"""
_NEWEST_FIRST = PAGE.replace("ORDER BY c.last_seq, e.o", "ORDER BY c.last_seq DESC, e.o DESC")
TAIL = f"SELECT * FROM ({_NEWEST_FIRST}) AS t ORDER BY seq"


def line_dict(seq: int, at: datetime, stream: str, text: str) -> dict:
    return {"seq": seq, "at": at, "stream": stream, "text": text}


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
        SELECT first_seq, sum(bytes) OVER (ORDER BY last_seq DESC) AS from_end
        FROM task_log_chunks WHERE task_id = %(task)s
    ), cut AS (
        SELECT COALESCE(min(first_seq), %(next)s) AS first, COALESCE(max(from_end), 0) AS bytes
        FROM kept WHERE from_end <= %(bound)s
    ), gone AS (
        DELETE FROM task_log_chunks WHERE task_id = %(task)s AND last_seq < (SELECT first FROM cut)
    )
    UPDATE task_log_state SET first_seq = (SELECT first FROM cut), stored_bytes = (SELECT bytes FROM cut)
    WHERE task_id = %(task)s
"""


def trim(task_id: int) -> bool:
    """Trim a task's chunks to its bound, the oldest first. Under the state row's lock, so
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
    return TASK_LOG_CHUNKS.prune_and_prepare(now, now - timedelta(days=settings.HETEROFLOW_TASK_LOG_RETENTION_DAYS))
