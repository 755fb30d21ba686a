"""The start-time estimates through the database (apps.scheduler.predictions): the job
writes every waiting task's and group's estimated_start, the API shows it, a task that
starts loses it (and keeps the first one it got), and a type the cluster lacks says so."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from apps.core.clock import utcnow
from apps.scheduler.core.forecast import TYPE_ABSENT
from apps.scheduler.jobs import predict_job
from apps.scheduler.models import GpuAllocation
from apps.scheduler.predictions import predict
from apps.tasks.models import Task, TaskGroup
from tests.factories import make_group, make_node, make_task
from tests.headers import bearer
from tests.portal.client import signed_in

pytestmark = pytest.mark.django_db


def running_on(node, tenant, cards, seconds_left):
    """A task running on `cards` of `node` that declared a duration ending `seconds_left` from now."""
    task = make_task(
        tenant,
        name="running",
        status="running",
        node=node,
        gpu_required=len(cards),
        started_at=utcnow() - timedelta(seconds=100),
        max_duration_seconds=100 + seconds_left,
    )
    for card in cards:
        GpuAllocation.objects.create(task=task, node=node, gpu_index=card, tenant=tenant)
    return task


def at(value: str) -> datetime:
    return datetime.fromisoformat(value)


def test_the_job_writes_estimates_the_api_shows_them_and_a_started_task_loses_its_own(api, world):
    acme = world.tenants["acme"]
    node = make_node("n1", gpus=8)
    running_on(node, acme, range(4), 1000)
    running_on(node, acme, range(4, 8), 3000)
    waiting = make_task(acme, name="big", gpu_required=8)
    absent = make_task(acme, name="amd", gpu_required=1, gpu_type="amd")
    group = make_group(acme, workers=1, gpus=8, priority=10)
    before = utcnow()
    assert predict_job() == "ran"

    waiting.refresh_from_db()
    estimate = waiting.estimated_start
    assert set(estimate) == {"p50", "p90", "computed_at", "basis"}
    # both running tasks declared their ends: the 8-card task starts when the second ends
    expected = before + timedelta(seconds=3000)
    assert abs((at(estimate["p50"]) - expected).total_seconds()) < 5
    assert estimate["p90"] == estimate["p50"]
    assert "2 declared duration" in estimate["basis"]
    assert waiting.first_estimate == estimate

    absent.refresh_from_db()
    assert absent.estimated_start["p50"] is None
    assert absent.estimated_start["basis"] == TYPE_ABSENT

    group.refresh_from_db()
    # the 8-card group of lower priority comes after the 8-card task, which declares no
    # duration and has no history: it is expected to run its whole timeout
    expected_group = before + timedelta(seconds=3000 + waiting.timeout_seconds)
    assert abs((at(group.estimated_start["p50"]) - expected_group).total_seconds()) < 5
    member = Task.objects.get(group=group)
    assert member.estimated_start == group.estimated_start

    key = bearer(world.keys["acme-member"])
    shown = api.get(f"/api/v1/tasks/{waiting.pk}", **key).json()
    assert shown["estimated_start"] == estimate
    listed = {row["id"]: row for row in api.get("/api/v1/tasks", **key).json()["results"]}
    assert listed[waiting.pk]["estimated_start"] == estimate
    assert api.get(f"/api/v1/task-groups/{group.pk}", **key).json()["estimated_start"] == group.estimated_start

    # it starts: the next run takes its estimate away, the first one stays beside started_at
    Task.objects.filter(pk=waiting.pk).update(status="running", node=node, started_at=utcnow())
    Task.objects.filter(group=group).update(status="cancelled")
    predict()
    waiting.refresh_from_db()
    assert waiting.estimated_start is None
    assert waiting.first_estimate == estimate
    assert TaskGroup.objects.get(pk=group.pk).estimated_start is None
    assert api.get(f"/api/v1/tasks/{waiting.pk}", **key).json()["estimated_start"] is None


def test_work_that_fits_now_is_estimated_to_start_now(world):
    make_node("n1", gpus=2)
    task = make_task(world.tenants["acme"], gpu_required=1)
    predict()
    task.refresh_from_db()
    assert abs((at(task.estimated_start["p50"]) - utcnow()).total_seconds()) < 5
    assert task.estimated_start["basis"].startswith("fits now")


def test_the_portal_task_page_shows_the_estimate_or_why_there_is_none(client, world):
    acme = world.tenants["acme"]
    node = make_node("n1", gpus=8)
    running_on(node, acme, range(8), 3600)
    waiting = make_task(acme, name="big", gpu_required=8)
    absent = make_task(acme, name="amd", gpu_required=1, gpu_type="amd")
    predict()
    member = signed_in(client, world.users["acme-member"])
    html = member.get(f"/portal/tasks/{waiting.pk}/").content.decode()
    assert "data-estimate>" in html and "Expected to start around" in html
    html = member.get(f"/portal/tasks/{absent.pk}/").content.decode()
    assert 'data-estimate="none"' in html and TYPE_ABSENT in html
