"""How long work is expected to run, for the start-time forecast (docs/predictions.md).
Best source first: the duration the work declares (max_duration_seconds, past which the
agent stops it); else learned from this cluster's history, the p50 and p90 of the run
times of the same tenant's same work that completed (at least MIN_SAMPLES of them, the
latest RECENT_RUNS); else its timeout. Learned figures are read in one statement per kind
(single tasks, gang groups) for every key at once, never per task."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import orjson
from django.db import connection

from apps.scheduler.core.forecast import Duration
from apps.tasks.choices import TaskStatus

MIN_SAMPLES = 5  # fewer completed runs than this teach nothing worth a quantile
RECENT_RUNS = 200  # the latest runs of a kind of work: the work changes, old runs say less

DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class WorkKey:
    """The same work: a tenant's tasks of one name pattern (digits stripped: train-3 and
    train-17 are one), image and command."""

    tenant_id: int
    pattern: str
    image: str
    command: str  # the argv as JSON text (compared as jsonb)


@dataclass(frozen=True)
class GroupKey:
    """The same gang: WorkKey's, and its shape (workers, cards each, GPU type)."""

    work: WorkKey
    world_size: int
    gpus_per_worker: int
    gpu_type: str


@dataclass(frozen=True)
class Learned:
    p50: float
    p90: float
    samples: int


def work_key(tenant_id: int, name: str, image: str, command) -> WorkKey:
    return WorkKey(tenant_id, DIGITS.sub("", name or ""), image or "", orjson.dumps(command or []).decode())


# The learned quantiles of every wanted key in one statement: each key's latest completed
# runs (the tenant's tasks by the (tenant, status) index), their p50, p90 and count.
LEARN_TASKS = f"""
    SELECT w.n, percentile_cont(0.5) WITHIN GROUP (ORDER BY h.seconds),
           percentile_cont(0.9) WITHIN GROUP (ORDER BY h.seconds), count(*)
    FROM unnest(%s::int[], %s::bigint[], %s::text[], %s::text[], %s::text[]) AS w(n, tenant_id, pattern, image, command)
    JOIN LATERAL (
        SELECT extract(epoch FROM t.finished_at - t.started_at) AS seconds
        FROM tasks t
        WHERE t.tenant_id = w.tenant_id AND t.status = '{TaskStatus.COMPLETED}' AND t.group_id IS NULL
          AND t.started_at IS NOT NULL AND t.finished_at IS NOT NULL
          AND regexp_replace(t.name, '[0-9]+', '', 'g') = w.pattern
          AND t.image = w.image AND t.command = w.command::jsonb
        ORDER BY t.finished_at DESC LIMIT {RECENT_RUNS}
    ) h ON true
    GROUP BY w.n
"""
# A gang's run: from its first member's start to its last member's end, for the groups
# whose members all completed (a group with a failed or stopped attempt is no sample).
LEARN_GROUPS = f"""
    SELECT w.n, percentile_cont(0.5) WITHIN GROUP (ORDER BY h.seconds),
           percentile_cont(0.9) WITHIN GROUP (ORDER BY h.seconds), count(*)
    FROM unnest(%s::int[], %s::bigint[], %s::text[], %s::text[], %s::text[], %s::int[], %s::int[], %s::text[])
        AS w(n, tenant_id, pattern, image, command, world_size, per_worker, gpu_type)
    JOIN LATERAL (
        SELECT extract(epoch FROM max(t.finished_at) - min(t.started_at)) AS seconds
        FROM task_groups g JOIN tasks t ON t.group_id = g.id
        WHERE g.tenant_id = w.tenant_id AND g.placement = 'gang'
          AND regexp_replace(g.name, '[0-9]+', '', 'g') = w.pattern
          AND g.image = w.image AND g.command = w.command::jsonb
          AND g.world_size = w.world_size AND g.gpus_per_worker = w.per_worker AND g.gpu_type = w.gpu_type
        GROUP BY g.id
        HAVING bool_and(t.status = '{TaskStatus.COMPLETED}' AND t.started_at IS NOT NULL AND t.finished_at IS NOT NULL)
        ORDER BY max(t.finished_at) DESC LIMIT {RECENT_RUNS}
    ) h ON true
    GROUP BY w.n
"""


def learned_tasks(keys: Iterable[WorkKey]) -> dict[WorkKey, Learned]:
    """The learned run times of single tasks' work, for the keys with any completed run
    (the caller decides whether the sample is large enough: Learned.samples)."""
    wanted = sorted(set(keys), key=lambda key: (key.tenant_id, key.pattern, key.image, key.command))
    if not wanted:
        return {}
    columns = [
        list(range(len(wanted))),
        [key.tenant_id for key in wanted],
        [key.pattern for key in wanted],
        [key.image for key in wanted],
        [key.command for key in wanted],
    ]
    return _learn(LEARN_TASKS, columns, wanted)


def learned_groups(keys: Iterable[GroupKey]) -> dict[GroupKey, Learned]:
    """learned_tasks for gangs of a shape."""
    wanted = sorted(
        set(keys),
        key=lambda key: (key.work.tenant_id, key.work.pattern, key.work.image, key.work.command, key.world_size),
    )
    if not wanted:
        return {}
    columns = [
        list(range(len(wanted))),
        [key.work.tenant_id for key in wanted],
        [key.work.pattern for key in wanted],
        [key.work.image for key in wanted],
        [key.work.command for key in wanted],
        [key.world_size for key in wanted],
        [key.gpus_per_worker for key in wanted],
        [key.gpu_type for key in wanted],
    ]
    return _learn(LEARN_GROUPS, columns, wanted)


def _learn(sql: str, columns: list[list], wanted: list) -> dict:
    with connection.cursor() as cursor:
        cursor.execute(sql, columns)
        rows = cursor.fetchall()
    return {wanted[n]: Learned(float(p50), float(p90), samples) for n, p50, p90, samples in rows}


def expected(declared: int | None, learned: Learned | None, timeout: int | None) -> Duration:
    """The expected run time from the best source there is: the declared duration, the
    learned quantiles (MIN_SAMPLES runs or more; never past the timeout, which stops it),
    else the timeout."""
    if declared:
        return Duration(float(declared), float(declared), "declared duration")
    if learned is not None and learned.samples >= MIN_SAMPLES:
        cap = float(timeout) if timeout else float("inf")
        return Duration(min(learned.p50, cap), min(learned.p90, cap), f"learned from {learned.samples} completed runs")
    return Duration(float(timeout or 0), float(timeout or 0), "timeout")
