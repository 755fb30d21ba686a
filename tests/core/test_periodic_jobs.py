"""A periodic job is declared once (`@periodic_job` in its app's jobs.py): the Celery task,
the guard's key and period, and beat's entry all come from that one declaration."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from celery import current_app

from apps.core import guard
from apps.core.guard import Outcome, declared_jobs, periodic_job
from heteroflow.beat import beat_schedule

pytestmark = pytest.mark.django_db

REPO = Path(__file__).resolve().parents[2]

# name → (every, per host): the periods the jobs had when they were declared in three places
EXPECTED = {
    "core.purge_expired_sessions": (3600.0, False),
    "nodes.check_health": (5.0, False),
    "nodes.energy_rollup": (300.0, False),
    "nodes.prune_metrics": (600.0, False),
    "nodes.image_janitor": (60.0, False),
    "nodes.gpu_health_recovery": (300.0, False),
    "scheduler.tick": (5.0, False),
    "scheduler.preemption_watchdog": (30.0, False),
    "scheduler.queue_usage": (60.0, False),
    "scheduler.predict": (30.0, False),
    "scheduler.simulations_sweep": (60.0, False),
    "tunnel.reclaim_idle": (60.0, False),
    "alerts.sweep": (30.0, False),
    "alerts.dispatch_notifications": (10.0, False),
    "alerts.prune": (3600.0, False),
    "monitoring.collect_server_metrics": (30.0, True),
    "monitoring.prune_server_metrics": (3600.0, False),
    "inference.rebuild": (10.0, False),
    "inference.autoscale": (30.0, False),
    "inference.windows": (60.0, False),
    "inference.lending_patrol": (15.0, False),
    "slices.gc": (60.0, False),
    "slices.compensate": (60.0, False),
    "tasks.prune_logs": (600.0, False),
}


def test_every_periodic_job_is_one_declaration_with_its_period():
    jobs = declared_jobs()
    assert {name: (job.every, job.per_host) for name, job in jobs.items()} == EXPECTED
    assert all(name in current_app.tasks for name in jobs)
    schedule = beat_schedule()
    assert schedule == {
        name: {"task": name, "schedule": every, "args": (), "options": {"expires": every}}
        for name, (every, per_host) in EXPECTED.items()
        if not per_host
    }


def test_only_the_declaration_runs_a_job_under_the_guard():
    """No jobs.py calls run_periodic or declares a periodic task by hand any more."""
    for path in sorted((REPO / "apps").rglob("jobs.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "run_periodic", f"{path}:{node.lineno}: declare the job with @periodic_job"


@pytest.fixture
def scratch_job(request):
    name = f"test.{request.node.name}"  # Celery keeps a task's name for good: one per test
    yield name
    guard._DECLARED.pop(name, None)


def test_a_declared_job_runs_its_body_under_its_guard_and_period(scratch_job):
    ran = []

    @periodic_job(scratch_job, every=60)
    def scratch():
        ran.append("ran")
        return 7

    assert current_app.tasks[scratch_job] is not None
    assert scratch() == Outcome.RAN
    assert scratch() == Outcome.EARLY  # within its period
    assert scratch(immediate=True) == Outcome.RAN  # on demand: not held back by the period
    assert ran == ["ran", "ran"]
    assert scratch_job in beat_schedule()
    with pytest.raises(ValueError, match="declared twice"):
        periodic_job(scratch_job, every=5)(lambda: None)


def test_a_per_host_job_is_guarded_per_host(scratch_job):
    from apps.core.models import JobRun

    host = ["cp-a"]
    scratch = periodic_job(scratch_job, every=60, host_name=lambda: host[0])(lambda: None)
    assert scratch() == Outcome.RAN
    host[0] = "cp-b"
    assert scratch() == Outcome.RAN  # another host, its own guard
    assert scratch() == Outcome.EARLY
    assert set(JobRun.objects.filter(key__startswith=scratch_job).values_list("key", flat=True)) == {
        f"{scratch_job}@cp-a",
        f"{scratch_job}@cp-b",
    }
    assert scratch_job not in beat_schedule()  # each worker sends it to its own host
