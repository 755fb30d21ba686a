"""`manage.py run_jobs`: every periodic job back to back, for the storm test and by hand."""

import io
import json

import pytest
from django.core.management import call_command

from apps.core.guard import Outcome
from apps.core.models import JobRun

pytestmark = pytest.mark.django_db(transaction=True)


def run(*args) -> dict:
    out = io.StringIO()
    call_command("run_jobs", *args, stdout=out)
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_the_named_jobs_run_on_demand_back_to_back_and_are_summed_up():
    summary = run("--seconds", "0.5", "--only", "nodes.check_health", "--only", "alerts.prune")
    assert set(summary) == {"nodes.check_health", "alerts.prune"}
    for figures in summary.values():
        # not held back by the period: more than one run in half a second
        assert figures["outcomes"].get(Outcome.RAN, 0) > 1, figures
        assert 0 <= figures["mean_seconds"] <= figures["max_seconds"]
    assert JobRun.objects.get(key="nodes.check_health").runs == summary["nodes.check_health"]["outcomes"]["ran"]


def test_a_failing_job_fails_the_command(monkeypatch):
    from apps.nodes import services

    monkeypatch.setattr(services, "REFRESH_STATUSES", "SELECT no_such_column FROM nodes")
    out = io.StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command("run_jobs", "--seconds", "0.2", "--only", "nodes.check_health", stdout=out)
    assert exited.value.code == 1
    assert json.loads(out.getvalue())["nodes.check_health"]["outcomes"].get(Outcome.FAILED, 0) >= 1


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--seconds", "0"), "--seconds must be more than 0"),
        (("--seconds", "1", "--only", "no.such_job"), "no such periodic job: no.such_job"),
    ],
)
def test_bad_input_is_refused_and_nothing_runs(args, said, capsys):
    err = io.StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command("run_jobs", *args, stderr=err)
    assert exited.value.code == 2 and said in err.getvalue()
    assert not JobRun.objects.exists()
