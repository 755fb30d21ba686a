"""The start-time estimates (docs/predictions.md): the snapshot, the waiting queue (every
pending single task up to PREDICT_CAP, every waiting gang), the running work and the
tenants' queues read once; the core's forecast run on them; every pending task's and
waiting group's `estimated_start` written in one statement per table. Read-only towards
the scheduler: it moves no queue cursor and touches no reservation."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import orjson
from django.conf import settings as django_settings
from django.db import connection

from apps.core.clock import utcnow
from apps.scheduler import quotas
from apps.scheduler.core import GroupReq, TaskReq
from apps.scheduler.core.forecast import Duration, Estimate, estimate, item_key
from apps.scheduler.core.queues import holdings_of
from apps.scheduler.durations import GroupKey, WorkKey, expected, learned_groups, learned_tasks, work_key
from apps.scheduler.plugins import plugin_settings, sharing_rule
from apps.scheduler.queue import SINGLE_SQL, group_request, jsonb, task_request
from apps.scheduler.reservations import reserving_groups
from apps.scheduler.snapshot import load_nodes
from apps.tasks.choices import TERMINAL
from apps.tasks.models import Task

PREDICT_CAP = 5000  # pending single tasks forecast per run, in queue order (the rest keep their last estimate)
# The accuracy record (docs/predictions.md#accuracy): a task keeps its first estimate, then
# one per SAMPLE_EVERY of waiting, at most SAMPLES_KEPT (a week of hours).
SAMPLE_EVERY = timedelta(hours=1)
SAMPLES_KEPT = 168
# A wait suggestion names the running task whose expected end frees the cards when that
# end is this close to the estimated start (beyond it, simulated work ahead ends last).
WAIT_NAMED_WITHIN = timedelta(minutes=1)

# Every pending single task in queue order, with what its expected duration is learned by.
PENDING_SQL = f"""
    SELECT id, tenant_id, gpu_required, gpu_memory_mb, gpu_type, priority, labels, kind, created_at, group_id,
           runtime, affinity, anti_affinity, max_duration_seconds, name, image, command, timeout_seconds
    FROM tasks WHERE status = 'pending' AND {SINGLE_SQL}
    ORDER BY priority DESC, created_at, id LIMIT %s
"""
# The gangs waiting to be placed (every current member pending, every rank there), as the
# scheduler's window reads them (apps.scheduler.queue.WAITING_GROUPS_SQL) without moving
# its cursor, with each one's stored reservation report and what its duration is learned by.
WAITING_GROUPS_SQL = """
    SELECT g.id, g.tenant_id, g.gpus_per_worker, g.gpu_type, g.strategy, g.priority, g.labels, g.kind,
           g.created_at, array_agg(t.id ORDER BY t.rank), g.reservation, g.runtime, g.affinity, g.anti_affinity,
           CASE WHEN bool_and(t.max_duration_seconds IS NOT NULL) THEN max(t.max_duration_seconds) END,
           g.name, g.image, g.command, g.world_size, max(t.timeout_seconds)
    FROM task_groups g JOIN tasks t ON t.group_id = g.id AND NOT (t.status = ANY(%s))
    WHERE g.placement = 'gang'
      AND g.id IN (SELECT group_id FROM tasks WHERE status = 'pending' AND group_id IS NOT NULL)
    GROUP BY g.id
    HAVING bool_and(t.status = 'pending') AND count(*) = g.world_size
"""
# The work holding cards (the ledger's tasks), with when it started and what its duration
# is learned by (a gang's member by its group's).
RUNNING_SQL = """
    SELECT t.id, t.tenant_id, t.name, t.image, t.command, t.started_at, t.max_duration_seconds, t.timeout_seconds,
           g.id, g.name, g.image, g.command, g.world_size, g.gpus_per_worker, g.gpu_type
    FROM tasks t LEFT JOIN task_groups g ON g.id = t.group_id AND g.placement = 'gang'
    WHERE t.id IN (SELECT DISTINCT task_id FROM gpu_allocations)
"""
# The writers: every row the forecast covered gets its estimate (a task that left the
# queue since it was read gets none), and every row still carrying one that is no longer
# waiting loses it; rows taken in id order, a row another writer holds skipped (it keeps
# its last estimate until the next run; docs/architecture.md, the writers table).
WRITE_TASKS = """
    WITH v AS (
        SELECT u.id, u.estimate FROM unnest(%s::bigint[], %s::jsonb[]) AS u(id, estimate)
        UNION ALL
        SELECT s.id, NULL::jsonb FROM tasks s
        WHERE s.estimated_start IS NOT NULL AND s.status <> 'pending' AND NOT (s.id = ANY(%s::bigint[]))
    ),
    locked AS (SELECT id FROM tasks WHERE id IN (SELECT id FROM v) ORDER BY id FOR UPDATE SKIP LOCKED)
    UPDATE tasks AS t
    SET estimated_start = CASE WHEN t.status = 'pending' THEN v.estimate END,
        estimate_samples = CASE
            WHEN t.status = 'pending' AND jsonb_typeof(v.estimate -> 'p50') = 'string'
             AND (t.estimate_samples IS NULL
                  OR (jsonb_array_length(t.estimate_samples) < %s
                      AND (t.estimate_samples -> -1 ->> 'computed_at')::timestamptz
                          <= (v.estimate ->> 'computed_at')::timestamptz - make_interval(secs => %s)))
            THEN coalesce(t.estimate_samples, '[]'::jsonb) || jsonb_build_array(jsonb_build_object(
                'computed_at', v.estimate -> 'computed_at', 'p50', v.estimate -> 'p50', 'p90', v.estimate -> 'p90'))
            ELSE t.estimate_samples END
    FROM v WHERE t.id = v.id AND t.id IN (SELECT id FROM locked)
"""
WRITE_GROUPS = """
    WITH v AS (
        SELECT u.id, u.estimate FROM unnest(%s::bigint[], %s::jsonb[]) AS u(id, estimate)
        UNION ALL
        SELECT s.id, NULL::jsonb FROM task_groups s
        WHERE s.estimated_start IS NOT NULL AND NOT (s.id = ANY(%s::bigint[]))
    ),
    locked AS (SELECT id FROM task_groups WHERE id IN (SELECT id FROM v) ORDER BY id FOR UPDATE SKIP LOCKED)
    UPDATE task_groups AS g SET estimated_start = v.estimate
    FROM v WHERE g.id = v.id AND g.id IN (SELECT id FROM locked)
"""


@dataclass
class Waiting:
    """The queue as the forecast takes it, and what each item's duration is learned by."""

    queue: list[TaskReq | GroupReq]
    keys: dict[tuple[str, int], WorkKey | GroupKey]
    declared: dict[tuple[str, int], int | None]
    timeouts: dict[tuple[str, int], int]
    heads: dict[int, dict]  # the groups with a stored reservation report: id -> the report


@dataclass
class PredictResult:
    tasks: int = 0
    groups: int = 0
    placed: int = 0  # items with an estimate


def predict(now: datetime | None = None) -> PredictResult:
    """One pass: every pending task's and waiting group's estimate, written."""
    now = now or utcnow()
    waiting = read_waiting()
    result = PredictResult()
    nodes = load_nodes()
    running = read_running(now.timestamp())
    book = quotas.queue_book(now, used=holdings_of(nodes))
    durations = expected_durations(waiting)
    reserving = reserving_groups(waiting.heads, now, django_settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS)
    estimates = estimate(
        waiting.queue,
        nodes,
        plugin_settings(),
        sharing_rule(),
        now.timestamp(),
        running,
        durations,
        specs=list(book.specs.values()),
        history=book.history,
        reserving=reserving,
    )
    # what the durations rest on, running and waiting work together ("learned from 12
    # completed runs" counts as "learned")
    sources = Counter(duration.basis.split(" from ")[0] for duration in [*running.values(), *durations.values()])
    computed_at = now.isoformat()
    task_rows: dict[int, str] = {}
    group_rows: dict[int, str] = {}
    for item in waiting.queue:
        found = estimates[item_key(item)]
        document = orjson.dumps(as_document(found, computed_at, sources)).decode()
        result.placed += found.p50 is not None
        if isinstance(item, GroupReq):
            group_rows[item.id] = document
            for member in item.members:  # the members wait with their group
                task_rows[member] = document
        else:
            task_rows[item.id] = document
    with connection.cursor() as cursor:
        cursor.execute(
            WRITE_TASKS,
            [
                list(task_rows),
                list(task_rows.values()),
                list(task_rows),
                SAMPLES_KEPT,
                SAMPLE_EVERY.total_seconds(),
            ],
        )
        cursor.execute(WRITE_GROUPS, [list(group_rows), list(group_rows.values()), list(group_rows)])
    result.tasks, result.groups = len(task_rows), len(group_rows)
    return result


def as_document(found: Estimate, computed_at: str, sources: Counter) -> dict:
    """The estimate as the API shows it: ISO times, or null p50 with the basis saying why."""
    basis = found.basis
    if found.p50 is not None and sources:
        basis += (
            " (expected durations: " + ", ".join(f"{count} {name}" for name, count in sorted(sources.items())) + ")"
        )
    return {"p50": _iso(found.p50), "p90": _iso(found.p90), "computed_at": computed_at, "basis": basis}


def _iso(moment: float | None) -> str | None:
    return None if moment is None else datetime.fromtimestamp(moment, UTC).isoformat()


def read_waiting(cap: int = PREDICT_CAP) -> Waiting:
    """The pending single tasks (up to `cap`) and the waiting gangs, in one queue order."""
    entries: list[tuple[tuple, TaskReq | GroupReq]] = []
    waiting = Waiting([], {}, {}, {}, {})
    with connection.cursor() as cursor:
        cursor.execute(PENDING_SQL, [cap])
        for row in cursor.fetchall():
            task_id, tenant_id, priority, created = row[0], row[1], row[5], row[8]
            max_duration, name, image, command, timeout = row[13:18]
            task = task_request(*row[:8], row[9], *row[10:14])  # the columns as QUEUE_SQL gives them, less `created`
            entries.append(((-priority, created, task_id), task))
            key = item_key(task)
            waiting.keys[key] = work_key(tenant_id, name, image, _json_list(command))
            waiting.declared[key], waiting.timeouts[key] = max_duration, timeout
        cursor.execute(WAITING_GROUPS_SQL, [list(TERMINAL)])
        for row in cursor.fetchall():
            gid, tenant_id, per_worker, gpu_type, strategy, priority, labels, kind, created, members = row[:10]
            stored, runtime, affinity, anti_affinity, max_duration, name, image, command, world, timeout = row[10:]
            group = group_request(
                gid,
                tenant_id,
                members,
                per_worker,
                gpu_type,
                strategy,
                priority,
                labels,
                kind,
                runtime,
                affinity,
                anti_affinity,
                max_duration,
            )
            entries.append(((-priority, created, members[0]), group))
            key = item_key(group)
            waiting.keys[key] = GroupKey(
                work_key(tenant_id, name, image, _json_list(command)), world, per_worker, gpu_type
            )
            waiting.declared[key], waiting.timeouts[key] = max_duration, timeout
            report = jsonb(stored)
            if report:
                waiting.heads[gid] = report
    entries.sort(key=lambda entry: entry[0])
    waiting.queue = [item for _, item in entries]
    return waiting


def expected_durations(waiting: Waiting) -> dict[tuple[str, int], Duration]:
    """Each waiting item's expected run time (apps.scheduler.durations.expected)."""
    learned = learn(waiting.keys.values())
    return {
        key: expected(waiting.declared[key], learned.get(work), waiting.timeouts[key])
        for key, work in waiting.keys.items()
    }


def learn(keys) -> dict:
    """The learned run times of the keys, single tasks' and gangs' in one statement each."""
    keys = list(keys)
    return learned_tasks(key for key in keys if isinstance(key, WorkKey)) | learned_groups(
        key for key in keys if isinstance(key, GroupKey)
    )


def read_running(now: float) -> dict[int, Duration]:
    """When each task holding cards is expected to end (absolute p50 and p90): from its
    start (a task bound and not started: from now) plus its expected duration. One past
    that is expected to end by its hard limit (declared duration, else timeout), and one
    past that too at any moment (a second from now)."""
    with connection.cursor() as cursor:
        cursor.execute(RUNNING_SQL)
        rows = cursor.fetchall()
    keys: dict[int, WorkKey | GroupKey] = {}
    for (
        task_id,
        tenant_id,
        name,
        image,
        command,
        _,
        _,
        _,
        gid,
        gname,
        gimage,
        gcommand,
        world,
        per_worker,
        gtype,
    ) in rows:
        if gid is not None:
            keys[task_id] = GroupKey(work_key(tenant_id, gname, gimage, _json_list(gcommand)), world, per_worker, gtype)
        else:
            keys[task_id] = work_key(tenant_id, name, image, _json_list(command))
    learned = learn(keys.values())
    ends = {}
    for task_id, _, _, _, _, started, declared, timeout, *_ in rows:
        start = started.timestamp() if started else now
        duration = expected(declared, learned.get(keys[task_id]), timeout)
        hard = start + (declared or timeout or 0)
        ends[task_id] = Duration(
            _end(start + duration.p50, hard, now), _end(start + duration.p90, hard, now), duration.basis
        )
    return ends


def _end(expected_end: float, hard_end: float, now: float) -> float:
    if expected_end > now:
        return expected_end
    return hard_end if hard_end > now else now + 1


def _json_list(value) -> list:
    if not value:
        return []
    return orjson.loads(value) if isinstance(value, (str, bytes)) else value


# How far ahead an estimate was (the real start less when it was made), in the bands the
# accuracy report groups by: (label, from seconds, to seconds or None).
LEAD_BANDS = (
    ("under 10 minutes", 0, 600),
    ("10 minutes to 1 hour", 600, 3600),
    ("1 to 6 hours", 3600, 6 * 3600),
    ("6 to 24 hours", 6 * 3600, 24 * 3600),
    ("over 24 hours", 24 * 3600, None),
)
# Every kept estimate (a p50 given) of the tasks that started since a moment: how far
# ahead it was made, and how far off its p50 was. A gang counts once, by its rank 0.
ACCURACY_SQL = """
    WITH kept AS (
        SELECT x.ordinality = 1 AS at_submission,
               extract(epoch FROM t.started_at - (x.sample ->> 'computed_at')::timestamptz) AS lead,
               abs(extract(epoch FROM (x.sample ->> 'p50')::timestamptz - t.started_at)) AS error
        FROM tasks t
        CROSS JOIN LATERAL jsonb_array_elements(t.estimate_samples) WITH ORDINALITY AS x(sample, ordinality)
        WHERE t.started_at >= %s AND t.estimate_samples IS NOT NULL AND (t.group_id IS NULL OR t.rank = 0)
          AND jsonb_typeof(x.sample -> 'p50') = 'string'
    )
    SELECT band, count(*),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY error),
           percentile_cont(0.9) WITHIN GROUP (ORDER BY error),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY error / greatest(lead, 1))
    FROM (
        SELECT CASE {bands} END AS band, lead, error FROM kept WHERE lead >= 0
        UNION ALL
        SELECT -1, lead, error FROM kept WHERE at_submission AND lead >= %s
    ) banded
    GROUP BY band
"""


def accuracy(since: datetime, long_wait_seconds: int = 600) -> dict:
    """How far off the kept estimates of the tasks that started since `since` were, by
    how far ahead they were made: per band the count and the median and 90th-percentile
    absolute error (seconds), and the median error relative to the wait that was left.
    `at_submission` is the first estimate of each task that waited over `long_wait_seconds`
    (issue 34's target: a median relative error of at most 30 %)."""
    cases = " ".join(
        f"WHEN lead < {end} THEN {index}" if end is not None else f"ELSE {index}"
        for index, (_, _, end) in enumerate(LEAD_BANDS)
    )
    with connection.cursor() as cursor:
        cursor.execute(ACCURACY_SQL.format(bands=cases), [since, long_wait_seconds])
        found = {row[0]: row for row in cursor.fetchall()}

    def summary(row) -> dict:
        if row is None:
            return {"estimates": 0} | dict.fromkeys(
                ("median_error_seconds", "p90_error_seconds", "median_relative_error")
            )
        return {
            "estimates": row[1],
            "median_error_seconds": round(row[2], 1),
            "p90_error_seconds": round(row[3], 1),
            "median_relative_error": round(row[4], 3),
        }

    return {
        "since": since.isoformat(),
        "bands": [
            {"lead": label, "from_seconds": start, "to_seconds": end} | summary(found.get(index))
            for index, (label, start, end) in enumerate(LEAD_BANDS)
        ],
        "at_submission": {"min_wait_seconds": long_wait_seconds} | summary(found.get(-1)),
    }


def waiting_for(estimate: dict | None, now: datetime | None = None) -> dict | None:
    """The suggestion to wait, from a waiting item's estimate: when it is expected to
    start and, where a running task's expected end is what frees its cards (within
    WAIT_NAMED_WITHIN of the start), that task. None without an estimate, or when it
    fits now."""
    if not estimate or not estimate.get("p50"):
        return None
    now = now or utcnow()
    start = datetime.fromisoformat(estimate["p50"])
    if start <= now + WAIT_NAMED_WITHIN:
        return None
    ends = read_running(now.timestamp())
    before = [(end.p50, task_id) for task_id, end in ends.items() if end.p50 <= start.timestamp() + 1]
    last_end, last = max(before, default=(None, None))
    why = f"wait: expected to start at about {estimate['p50']} once the work ahead of it ends"
    if last is not None and start.timestamp() - last_end <= WAIT_NAMED_WITHIN.total_seconds():
        name = Task.objects.filter(pk=last).values_list("name", flat=True).first()
        why = f"wait for task {last} ({name}) to end at about {_iso(last_end)}"
    return {"change": {}, "starts": estimate["p50"], "why": why}


def suggestion_rows(detail: dict, estimate: dict | None) -> list[dict]:
    """Explain's suggestions (docs/predictions.md#suggestions): those the dry run found
    (popped from its detail, cycle.explain_now), each starting now, then the wait the
    item's estimate foresees."""
    rows = [{"change": found.change, "starts": "now", "why": found.why} for found in detail.pop("suggestions", [])]
    wait = waiting_for(estimate)
    return rows + [wait] if wait else rows
