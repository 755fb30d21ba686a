"""Work to replay (docs/simulate.md#traces): a trace file (JSONL or CSV), the published
Alibaba PAI GPU trace (cluster-trace-gpu-v2020's pai_task_table, with pai_job_table for
the users), or a generated one whose statistics are documented. Each gives
apps.scheduler.core.replay.Job rows, tenants named by text and numbered here (`Tenants`).
No database: the shell (apps.scheduler.simulate) reads the cluster's own history."""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from apps.scheduler.core.replay import DAY, Job

TRACE_FIELDS = ("submit", "tenant", "gpus", "gpu_type", "duration", "priority", "workers", "declared")
REQUIRED = ("submit", "gpus", "duration")


class TraceError(ValueError):
    """A trace that cannot be read, naming the line and what is wrong with it."""


@dataclass
class Tenants:
    """Tenant names to the numbers the core uses, in order of first appearance."""

    ids: dict[str, int] = field(default_factory=dict)

    def id(self, name: str) -> int:
        return self.ids.setdefault(name, len(self.ids) + 1)

    def name(self, tenant_id: int) -> str:
        return next((name for name, number in self.ids.items() if number == tenant_id), str(tenant_id))


# --- a trace file ---------------------------------------------------------------------------------


def read_trace(path: str | Path, tenants: Tenants) -> list[Job]:
    """A JSONL file (one object per line) or a CSV file with a header, of the fields
    TRACE_FIELDS: `submit` (seconds from the trace's start), `gpus` (per worker) and
    `duration` (seconds) required; `tenant` ("default"), `gpu_type` ("nvidia"), `priority`
    (50), `workers` (1) and `declared` (a declared max duration) optional. Every problem
    is a TraceError naming its line; nothing is returned for a file with one."""
    path = Path(path)
    with path.open(newline="") as handle:
        if path.suffix.lower() == ".csv":
            rows: Iterable[tuple[int, dict]] = enumerate(csv.DictReader(handle), start=2)
        else:
            rows = _json_lines(handle)
        jobs = [_job(number, row, tenants, index) for index, (number, row) in enumerate(rows, start=1)]
    if not jobs:
        raise TraceError(f"{path}: no work in it.")
    return jobs


def jobs_from_rows(rows: Iterable[dict], tenants: Tenants) -> list[Job]:
    """Trace rows given as objects (POST /api/v1/admin/simulations), checked as a file's
    lines are: a problem names its row (1 is the first)."""
    jobs = []
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise TraceError(f"row {number}: an object is expected.")
        jobs.append(_job(number, row, tenants, number, where="row"))
    if not jobs:
        raise TraceError("no work in the trace.")
    return jobs


def _json_lines(handle) -> Iterator[tuple[int, dict]]:
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise TraceError(f"line {number}: not JSON ({exc}).") from None
        if not isinstance(row, dict):
            raise TraceError(f"line {number}: an object is expected.")
        yield number, row


def _job(number: int, row: dict, tenants: Tenants, job_id: int, where: str = "line") -> Job:
    missing = [name for name in REQUIRED if row.get(name) in (None, "")]
    unknown = sorted(set(row) - set(TRACE_FIELDS))
    if missing or unknown:
        problems = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unknown {', '.join(unknown)}"] if unknown else []
        )
        raise TraceError(f"{where} {number}: {'; '.join(problems)}.")
    try:
        submit, duration = float(row["submit"]), float(row["duration"])
        gpus, workers = int(row["gpus"]), int(row.get("workers") or 1)
        priority = int(row.get("priority") or 50)
        declared = float(row["declared"]) if row.get("declared") not in (None, "") else None
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where} {number}: {exc}.") from None
    if submit < 0 or duration <= 0 or gpus < 0 or workers < 1 or not (0 <= priority <= 100):
        raise TraceError(
            f"{where} {number}: submit ≥ 0, duration > 0, gpus ≥ 0, workers ≥ 1 and priority 0–100 are expected."
        )
    return Job(
        id=job_id,
        submit=submit,
        tenant_id=tenants.id(str(row.get("tenant") or "default")),
        gpus=gpus,
        duration=duration,
        gpu_type=str(row.get("gpu_type") or "nvidia").lower(),
        priority=priority,
        workers=workers,
        declared=declared,
    )


def write_trace(jobs: Iterable[Job], path: str | Path, tenants: Tenants) -> None:
    """Jobs as a JSONL trace that read_trace reads back."""
    with Path(path).open("w") as handle:
        for job in jobs:
            row = {
                "submit": round(job.submit, 3),
                "tenant": tenants.name(job.tenant_id),
                "gpus": job.gpus,
                "gpu_type": job.gpu_type,
                "duration": round(job.duration, 3),
                "priority": job.priority,
                "workers": job.workers,
            }
            if job.declared is not None:
                row["declared"] = round(job.declared, 3)
            handle.write(json.dumps(row) + "\n")


# --- the Alibaba PAI GPU trace (cluster-trace-gpu-v2020) -----------------------------------------

# pai_task_table.csv, no header: a task of a job, inst_num instances of plan_gpu percent of
# a card each (100 is one card), from start_time to end_time (seconds from the trace's
# start); pai_job_table.csv, no header: the job's user.
PAI_TASK_COLUMNS = (
    "job_name",
    "task_name",
    "inst_num",
    "status",
    "start_time",
    "end_time",
    "plan_cpu",
    "plan_mem",
    "plan_gpu",
    "gpu_type",
)
PAI_JOB_COLUMNS = ("job_name", "inst_id", "user", "status", "start_time", "end_time")


@dataclass
class PaiImport:
    jobs: list[Job]
    skipped: dict[str, int]  # why -> rows


def read_pai(task_table: str | Path, tenants: Tenants, job_table: str | Path | None = None) -> PaiImport:
    """The PAI task table as jobs: each task that used GPUs and ran (Terminated, with both
    times) is one job of `inst_num` workers (a gang when more than one), each
    ceil(plan_gpu / 100) cards; submitted at its start_time, running end_time − start_time;
    tenant: the job's user from the job table (else "pai"); every PAI card is NVIDIA (the
    trace's gpu_type, V100, T4, …, is a model). Rows that do not qualify are counted by
    why, not fatal."""
    users: dict[str, str] = {}
    if job_table is not None:
        with Path(job_table).open(newline="") as handle:
            for row in csv.reader(handle):
                if len(row) >= 3 and row[0] != "job_name":
                    users[row[0]] = row[2] or "pai"
    jobs: list[Job] = []
    skipped: dict[str, int] = {}

    def skip(why: str) -> None:
        skipped[why] = skipped.get(why, 0) + 1

    with Path(task_table).open(newline="") as handle:
        for row in csv.reader(handle):
            if not row or row[0] == "job_name":
                continue
            if len(row) < len(PAI_TASK_COLUMNS):
                skip("too few columns")
                continue
            task = dict(zip(PAI_TASK_COLUMNS, row, strict=False))
            if task["status"] != "Terminated":
                skip(f"status {task['status'] or 'empty'}")
                continue
            try:
                start, end = float(task["start_time"]), float(task["end_time"])
                plan_gpu = float(task["plan_gpu"] or 0)
                instances = int(float(task["inst_num"] or 1))
            except ValueError:
                skip("unreadable numbers")
                continue
            if plan_gpu <= 0:
                skip("no GPU")
                continue
            if end <= start:
                skip("no run time")
                continue
            jobs.append(
                Job(
                    id=len(jobs) + 1,
                    submit=start,
                    tenant_id=tenants.id(users.get(task["job_name"], "pai")),
                    gpus=max(1, math.ceil(plan_gpu / 100)),
                    duration=end - start,
                    workers=max(1, instances),
                )
            )
    if jobs:
        origin = min(job.submit for job in jobs)
        jobs = [
            Job(job.id, job.submit - origin, job.tenant_id, job.gpus, job.duration, workers=job.workers) for job in jobs
        ]
    return PaiImport(jobs, skipped)


# --- a generated trace -----------------------------------------------------------------------------

# (cards per worker, workers, share of jobs): mostly one card, a few large gangs
SHAPES = (
    (1, 1, 0.70),
    (2, 1, 0.10),
    (4, 1, 0.08),
    (8, 1, 0.07),
    (8, 2, 0.03),
    (8, 4, 0.015),
    (8, 8, 0.005),
)
PRIORITIES = ((50, 0.80), (70, 0.15), (90, 0.05))
DURATION_MEDIAN = 1800.0  # seconds: half the jobs run under 30 minutes
DURATION_SIGMA = 1.5  # lognormal: heavy-tailed, the mean is about 3.1× the median
DURATION_MAX = 3 * DAY
DECLARED_SHARE = 0.3  # jobs that declare their duration (× 1–2 its real run time)


def generate(
    jobs: int,
    days: float,
    gpu_types: dict[str, int],
    tenants: Tenants,
    tenant_count: int = 4,
    seed: int = 1,
) -> list[Job]:
    """`jobs` jobs over `days` days (docs/simulate.md#the-generated-trace for the
    statistics): Poisson arrivals whose rate follows the day (twice as many at the day's
    peak as at its trough); shapes from SHAPES; durations lognormal around
    DURATION_MEDIAN (sigma DURATION_SIGMA, at most three days); priorities from
    PRIORITIES; tenants `tenant-1`… with Zipf shares (the first submits most); each GPU
    type in proportion to its cards in `gpu_types`; DECLARED_SHARE of the jobs declare a
    duration. The same seed gives the same trace."""
    rng = random.Random(seed)
    span = days * DAY
    names = [f"tenant-{n}" for n in range(1, tenant_count + 1)]
    zipf = [1 / rank for rank in range(1, tenant_count + 1)]
    types, cards = zip(*sorted(gpu_types.items()), strict=True) if gpu_types else (("nvidia",), (1,))
    submits = sorted(_arrival(rng, span) for _ in range(jobs))
    generated = []
    for number, submit in enumerate(submits, start=1):
        gpus, workers = _pick(rng, [((shape[0], shape[1]), shape[2]) for shape in SHAPES])
        duration = min(DURATION_MAX, max(30.0, rng.lognormvariate(math.log(DURATION_MEDIAN), DURATION_SIGMA)))
        declared = duration * rng.uniform(1.0, 2.0) if rng.random() < DECLARED_SHARE else None
        generated.append(
            Job(
                id=number,
                submit=submit,
                tenant_id=tenants.id(rng.choices(names, weights=zipf)[0]),
                gpus=gpus,
                duration=duration,
                gpu_type=rng.choices(types, weights=cards)[0],
                priority=_pick(rng, PRIORITIES),
                workers=workers,
                declared=declared,
            )
        )
    return generated


def _arrival(rng: random.Random, span: float) -> float:
    """A moment in [0, span) drawn with density 1 + 0.5 sin(2π t / day): by rejection."""
    while True:
        moment = rng.uniform(0, span)
        if rng.uniform(0, 1.5) <= 1 + 0.5 * math.sin(2 * math.pi * moment / DAY):
            return moment


def _pick(rng: random.Random, weighted):
    values, weights = zip(*weighted, strict=True)
    return rng.choices(values, weights=weights)[0]
