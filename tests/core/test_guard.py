"""The periodic-job guard under real concurrency: each runner is a thread with its own
PostgreSQL connection, so the advisory lock and the last-run row are exercised for real."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction

from apps.core import locks
from apps.core.clock import utcnow
from apps.core.guard import Outcome, run_guarded, run_periodic
from apps.core.models import JobRun

pytestmark = pytest.mark.django_db(transaction=True)
PERIOD = timedelta(seconds=5)


def in_own_connection(fn):
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            connection.close()

    return wrapper


def test_a_second_runner_is_busy_while_the_first_holds_the_tick():
    inside, release = threading.Event(), threading.Event()
    calls, results = [], {}

    def slow_work():
        calls.append("first")
        inside.set()
        assert release.wait(10)

    @in_own_connection
    def first():
        results["first"] = run_guarded("test.slow", PERIOD, slow_work)

    @in_own_connection
    def second():
        results["second"] = run_guarded("test.slow", PERIOD, lambda: calls.append("second"))

    one = threading.Thread(target=first)
    one.start()
    assert inside.wait(10)
    two = threading.Thread(target=second)
    two.start()
    two.join(10)
    assert not two.is_alive(), "the second runner must not queue behind the lock"
    release.set()
    one.join(10)
    assert results["first"].outcome == Outcome.RAN
    assert results["second"].outcome == Outcome.BUSY
    assert calls == ["first"]
    assert JobRun.objects.get(key="test.slow").runs == 1


def test_many_simultaneous_deliveries_run_the_tick_exactly_once():
    runners = 8
    barrier = threading.Barrier(runners)
    calls, outcomes, lock = [], [], threading.Lock()

    def work():
        with lock:
            calls.append(1)
        threading.Event().wait(0.2)  # hold the tick long enough for every runner to arrive

    @in_own_connection
    def runner():
        barrier.wait(10)
        result = run_guarded("test.burst", PERIOD, work)
        with lock:
            outcomes.append(result.outcome)

    threads = [threading.Thread(target=runner) for _ in range(runners)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert len(calls) == 1
    assert outcomes.count(Outcome.RAN) == 1
    assert set(outcomes) <= {Outcome.RAN, Outcome.BUSY, Outcome.EARLY}
    assert len(outcomes) == runners


def test_an_early_tick_is_skipped_and_a_due_one_runs():
    start = utcnow()
    assert run_guarded("test.period", PERIOD, lambda: 1, now=start).outcome == Outcome.RAN
    # a redelivered message or a second beat, one second later
    assert run_guarded("test.period", PERIOD, lambda: 2, now=start + timedelta(seconds=1)).outcome == Outcome.EARLY
    # beat's own jitter: a tick slightly inside the period still runs
    assert run_guarded("test.period", PERIOD, lambda: 3, now=start + timedelta(seconds=4.5)).value == 3
    assert JobRun.objects.get(key="test.period").runs == 2


def test_a_failing_job_rolls_back_its_writes_but_records_the_failure():
    def failing():
        JobRun.objects.create(key="written-by-the-failing-job")
        raise RuntimeError("boom")

    result = run_guarded("test.fail", PERIOD, failing)
    assert result.outcome == Outcome.FAILED
    assert not JobRun.objects.filter(key="written-by-the-failing-job").exists()
    run = JobRun.objects.get(key="test.fail")
    assert run.last_outcome == "failed" and "boom" in run.last_error and run.last_finished_at


def test_each_run_that_ran_adds_its_work_duration_and_an_early_tick_adds_none():
    spans = []  # (start, end) of each run's work, as the work itself saw them

    def timed(fail=False):
        def work():
            start = time.monotonic()
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_class")
            spans.append((start, time.monotonic()))
            if fail:
                raise RuntimeError("boom")

        return work

    start = utcnow()
    outside = time.monotonic()
    assert run_guarded("test.timed", PERIOD, timed(), now=start).outcome == Outcome.RAN
    assert run_guarded("test.timed", PERIOD, timed(), now=start + timedelta(seconds=1)).outcome == Outcome.EARLY
    failed = run_guarded("test.timed", PERIOD, timed(fail=True), now=start + timedelta(seconds=10))
    assert failed.outcome == Outcome.FAILED
    outside = time.monotonic() - outside

    run = JobRun.objects.get(key="test.timed")
    worked = [end - begin for begin, end in spans]
    assert len(worked) == 2 and run.runs == 2
    # each recorded duration covers its work and no more than the calls around it took
    assert sum(worked) <= run.total_seconds <= outside
    assert max(worked) <= run.max_seconds <= run.total_seconds


def test_a_busy_runner_records_no_duration():
    with transaction.atomic():
        assert locks.try_xact_lock("job:test.held")
        JobRun.objects.create(key="test.held", runs=3, total_seconds=1.5, max_seconds=0.75)
        # a second runner in its own connection finds the job's lock taken
        results = {}
        thread = threading.Thread(
            target=in_own_connection(lambda: results.update(r=run_guarded("test.held", PERIOD, lambda: 1)))
        )
        thread.start()
        thread.join(10)
    assert results["r"].outcome == Outcome.BUSY
    run = JobRun.objects.get(key="test.held")
    assert (run.runs, run.total_seconds, run.max_seconds) == (3, 1.5, 0.75)


def test_declared_jobs_use_their_beat_period():
    from apps.core.guard import declared_jobs
    from heteroflow.beat import beat_schedule

    PERIODIC_JOBS = declared_jobs()

    assert run_periodic("core.purge_expired_sessions", lambda: 0).outcome == Outcome.RAN
    assert run_periodic("core.purge_expired_sessions", lambda: 0).outcome == Outcome.EARLY
    schedule = beat_schedule()
    # per-host jobs are sent by each worker to its own host, not by beat
    assert set(schedule) == {key for key, job in PERIODIC_JOBS.items() if not job.per_host}
    assert schedule["core.purge_expired_sessions"]["schedule"] == PERIODIC_JOBS["core.purge_expired_sessions"].every


def test_the_session_purge_job_deletes_only_expired_sessions():
    from django.contrib.sessions.backends.db import SessionStore

    from apps.core.jobs import purge_expired_sessions_job

    live = SessionStore()
    live["x"] = 1
    live.create()
    expired = SessionStore()
    expired.set_expiry(-10)
    expired.create()
    assert purge_expired_sessions_job() == Outcome.RAN
    from django.contrib.sessions.models import Session

    assert list(Session.objects.values_list("session_key", flat=True)) == [live.session_key]
