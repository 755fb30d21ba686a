"""Replays an operator asks for through the API, `hf simulate` or the portal
(docs/simulate.md#from-the-api-hf-and-the-portal): the one writer of
scheduler_simulations. A request is checked whole before anything is written; it runs as
the job `scheduler.simulate`, outside any long transaction, so its progress shows while it
runs; the sweep sends again what a lost message left queued and fails what a dead worker
left running."""

from __future__ import annotations

import base64
import logging
import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import orjson
from django.db import connection

from apps.core.clock import utcnow
from apps.core.enqueue import enqueue
from apps.scheduler import simulate, traces
from apps.scheduler.core import NodeSnap
from apps.scheduler.core.replay import Job, Policy, replay
from apps.scheduler.models import Simulation

logger = logging.getLogger(__name__)

MAX_TRACE_ROWS = 200_000
MAX_POLICIES = 4
PROGRESS_STEP = 0.02  # the least progress written at once
RESEND_AFTER = timedelta(minutes=1)  # queued this long: its message was lost, sent again
STALE_AFTER = timedelta(minutes=30)  # running without progress this long: its worker is gone


@dataclass
class Inputs:
    fleet: list[NodeSnap]
    jobs: list[Job]
    policies: list[Policy]
    tenants: traces.Tenants


def inputs_of(request: dict, generating: bool = True) -> Inputs:
    """What a request (as SimulationRequestSerializer validated it) replays: raises
    SimulationInputError or TraceError, saying what is wrong. `generating` False: a
    generated trace is left empty (its parameters were validated; only the run makes it)."""
    tenants = traces.Tenants()
    fleet = simulate.fleet_from_document(request["fleet"]) if request.get("fleet") else simulate.fleet_of_cluster()
    if not fleet:
        raise simulate.SimulationInputError("fleet: this cluster has no schedulable node; describe one.")
    work = request["work"]
    if "trace" in work:
        jobs = traces.jobs_from_rows(work["trace"], tenants)
    elif "generate" in work and not generating:
        jobs = []
    elif "generate" in work:
        spec = work["generate"]
        jobs = traces.generate(
            spec["jobs"],
            spec.get("days", 2.0),
            simulate.gpu_types(fleet),
            tenants,
            tenant_count=spec.get("tenants", 4),
            seed=spec.get("seed", 1),
        )
    else:
        jobs = simulate.jobs_from_history(work["from_history_days"], tenants)
        if not jobs:
            raise simulate.SimulationInputError("work: no work that ran was submitted in that window.")
    policies = [
        simulate.policy_from_document(document, tenants, f"policies[{index}]")
        for index, document in enumerate(request.get("policies") or [])
    ] or [simulate.policy_of_cluster()]
    return Inputs(fleet, jobs, policies, tenants)


def request_simulation(user, request: dict) -> Simulation:
    """Queue a replay once its inputs are known to be good (raises otherwise, nothing
    written)."""
    inputs_of(request, generating=False)
    simulation = Simulation.objects.create(request=request, created_by=user)
    enqueue("scheduler.simulate", simulation.pk)
    return simulation


CLAIM = """
    UPDATE scheduler_simulations SET state = 'running', started_at = %s, moved_at = %s
    WHERE id = %s AND state = 'queued' RETURNING request
"""
MOVE = "UPDATE scheduler_simulations SET progress = %s, moved_at = %s WHERE id = %s AND state = 'running'"
FINISH = """
    UPDATE scheduler_simulations
    SET state = %s, progress = coalesce(%s, progress), report = %s::jsonb, charts = %s::jsonb, error = %s,
        finished_at = %s, moved_at = %s
    WHERE id = %s AND state = 'running'
"""


def run(simulation_id: int) -> str:
    """Run a queued replay: claim it (one worker does), replay each policy writing the
    progress as it goes, then its report and charts; a failure is its error. Each write
    is a statement of its own (autocommit): the progress shows while it runs."""
    with connection.cursor() as cursor:
        cursor.execute(CLAIM, [utcnow(), utcnow(), simulation_id])
        row = cursor.fetchone()
    if row is None:
        return "not queued"
    request = orjson.loads(row[0]) if isinstance(row[0], (str, bytes)) else row[0]
    try:
        found = inputs_of(request)
        comparison = simulate.Comparison(tenants=found.tenants)
        shown = [0.0]

        def moved(done: float) -> None:
            if done - shown[0] >= PROGRESS_STEP:
                shown[0] = done
                with connection.cursor() as cursor:
                    cursor.execute(MOVE, [round(done, 3), utcnow(), simulation_id])

        count = len(found.policies)
        for index, policy in enumerate(found.policies):
            comparison.runs.append(
                replay(found.jobs, found.fleet, policy, progress=lambda done, k=index: moved((k + done) / count))
            )
        charts = chart_pngs(comparison)
        _finish(simulation_id, Simulation.State.DONE, comparison.as_json(), charts, "")
        return "done"
    except (simulate.SimulationInputError, traces.TraceError) as exc:
        _finish(simulation_id, Simulation.State.FAILED, None, {}, str(exc))
    except Exception as exc:  # a replay that breaks is reported on the run, not lost in a log
        logger.exception("simulation %s failed", simulation_id)
        _finish(simulation_id, Simulation.State.FAILED, None, {}, f"{type(exc).__name__}: {exc}")
    return "failed"


def _finish(simulation_id: int, state: str, report: dict | None, charts: dict, error: str) -> None:
    now = utcnow()
    progress = 1.0 if state == Simulation.State.DONE else None
    with connection.cursor() as cursor:
        cursor.execute(
            FINISH,
            [state, progress, _json(report), _json(charts), error, now, now, simulation_id],
        )


def _json(value) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def chart_pngs(comparison: simulate.Comparison) -> dict[str, str]:
    """The charts (simulate.draw_charts) as base64 PNGs by name (utilisation, waits,
    fragmentation)."""
    with tempfile.TemporaryDirectory() as folder:
        paths = simulate.draw_charts(comparison, Path(folder))
        return {path.stem: base64.b64encode(path.read_bytes()).decode() for path in paths}


RESEND = "SELECT id FROM scheduler_simulations WHERE state = 'queued' AND created_at <= %s ORDER BY id"
GIVE_UP = """
    UPDATE scheduler_simulations SET state = 'failed', finished_at = %s,
           error = 'its worker stopped: no progress for ' || %s || ' minutes'
    WHERE id IN (SELECT id FROM scheduler_simulations WHERE state = 'running' AND moved_at <= %s
                 ORDER BY id FOR UPDATE SKIP LOCKED)
"""


def sweep(now: datetime | None = None) -> int:
    """Send again the replays queued for over RESEND_AFTER (the message was lost: a
    claimed one is not run twice), and fail those running without progress for
    STALE_AFTER (rows in id order, one a worker holds skipped). How many it touched."""
    now = now or utcnow()
    with connection.cursor() as cursor:
        cursor.execute(RESEND, [now - RESEND_AFTER])
        queued = [simulation_id for (simulation_id,) in cursor.fetchall()]
        cursor.execute(GIVE_UP, [now, int(STALE_AFTER.total_seconds() // 60), now - STALE_AFTER])
        stale = cursor.rowcount
    for simulation_id in queued:
        enqueue("scheduler.simulate", simulation_id)
    return len(queued) + stale
