"""Services ask for a job by its name, and it is sent once their transaction commits."""

from __future__ import annotations

import pytest
from celery import current_app, shared_task
from django.db import transaction

from apps.core.enqueue import enqueue, registered_task

pytestmark = pytest.mark.django_db

eager_runs: list[int] = []


@shared_task(name="test.enqueue_probe")
def probe_job(value: int) -> None:
    eager_runs.append(value)


@pytest.fixture
def sent(monkeypatch):
    calls = []
    monkeypatch.setattr(registered_task("scheduler.tick"), "apply_async", lambda **options: calls.append(options))
    return calls


def test_a_job_is_sent_by_name_after_the_commit(sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        with transaction.atomic():
            enqueue("scheduler.tick", immediate=True)
            assert sent == []  # not before the commit
    assert sent == [{"args": (), "kwargs": {"immediate": True}, "countdown": None}]


def test_a_rolled_back_transaction_sends_nothing(sent, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            enqueue("scheduler.tick")
            raise RuntimeError("rolled back")
    assert callbacks == [] and sent == []


def test_an_unknown_job_name_fails_in_the_caller():
    with pytest.raises(KeyError):
        enqueue("scheduler.no_such_job")


def test_a_broker_that_is_away_is_logged_not_raised(monkeypatch, caplog, django_capture_on_commit_callbacks):
    def broker_down(**options):
        raise ConnectionError("broker away")

    monkeypatch.setattr(registered_task("scheduler.tick"), "apply_async", broker_down)
    with django_capture_on_commit_callbacks(execute=True):
        enqueue("scheduler.tick", immediate=True)
    assert "could not queue the job scheduler.tick" in caplog.text


def test_eager_mode_runs_the_job_as_delay_would(django_capture_on_commit_callbacks):
    eager_runs.clear()
    current_app.conf.task_always_eager = True
    try:
        with django_capture_on_commit_callbacks(execute=True):
            enqueue("test.enqueue_probe", 3)
    finally:
        current_app.conf.task_always_eager = False
    assert eager_runs == [3]
