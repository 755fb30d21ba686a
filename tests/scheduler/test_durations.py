"""Expected durations (apps.scheduler.durations): the declared one first; else learned
from the same tenant's completed runs of the same work (name with digits stripped, image,
command; for a gang also its shape), p50 and p90 with the sample size, from MIN_SAMPLES
runs on; else the timeout."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.scheduler.durations import (
    MIN_SAMPLES,
    GroupKey,
    Learned,
    expected,
    learned_groups,
    learned_tasks,
    work_key,
)
from apps.tasks.models import Task
from tests.factories import make_group, make_task

pytestmark = pytest.mark.django_db

COMMAND = ["python", "train.py"]


def completed(tenant, name, seconds, image="x", command=COMMAND):
    end = utcnow() - timedelta(hours=1)
    return make_task(
        tenant,
        name=name,
        image=image,
        command=command,
        status="completed",
        started_at=end - timedelta(seconds=seconds),
        finished_at=end,
    )


def test_the_quantiles_of_the_same_works_runs_with_their_count(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    for n, seconds in enumerate([100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]):
        completed(acme, f"train-{n}", seconds)
    completed(acme, "train-99", 50_000, image="other")  # other work
    completed(acme, "train-98", 50_000, command=["python", "eval.py"])  # other work
    completed(beta, "train-1", 50_000)  # another tenant's
    make_task(acme, name="train-97", command=COMMAND, status="failed")  # not completed
    key = work_key(acme.pk, "train-123", "x", COMMAND)
    learned = learned_tasks([key, work_key(acme.pk, "nothing-1", "x", COMMAND)])
    assert set(learned) == {key}
    assert learned[key].samples == 10
    assert learned[key].p50 == pytest.approx(550)
    assert learned[key].p90 == pytest.approx(910)


def test_a_gang_learns_from_the_groups_of_its_shape_whose_members_all_completed(world):
    acme = world.tenants["acme"]
    end = utcnow() - timedelta(hours=1)
    for seconds in (1000, 2000, 3000):
        group = make_group(acme, workers=2, gpus=8, name="ddp-7", command=COMMAND)
        Task.objects.filter(group=group, rank=0).update(
            status="completed", started_at=end - timedelta(seconds=seconds), finished_at=end
        )
        Task.objects.filter(group=group, rank=1).update(
            status="completed", started_at=end - timedelta(seconds=seconds - 10), finished_at=end - timedelta(seconds=5)
        )
    failed = make_group(acme, workers=2, gpus=8, name="ddp-8", command=COMMAND)
    Task.objects.filter(group=failed).update(status="failed", started_at=end - timedelta(seconds=9), finished_at=end)
    make_group(acme, workers=4, gpus=8, name="ddp-9", command=COMMAND)  # another shape
    key = GroupKey(work_key(acme.pk, "ddp-1", "x", COMMAND), 2, 8, "nvidia")
    learned = learned_groups([key])
    assert learned[key].samples == 3
    assert learned[key].p50 == pytest.approx(2000)


def test_the_best_source_first():
    plenty, few = Learned(500, 900, MIN_SAMPLES), Learned(500, 900, MIN_SAMPLES - 1)
    assert expected(600, plenty, 7200) == expected(600, None, 7200)
    assert (expected(600, plenty, 7200).p50, expected(600, plenty, 7200).basis) == (600, "declared duration")
    learned = expected(None, plenty, 7200)
    assert (learned.p50, learned.p90, learned.basis) == (500, 900, f"learned from {MIN_SAMPLES} completed runs")
    assert (expected(None, few, 7200).p50, expected(None, few, 7200).basis) == (7200, "timeout")
    # the timeout stops it: never longer than that
    assert expected(None, plenty, 800).p90 == 800
