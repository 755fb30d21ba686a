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


def sample(estimate: dict) -> dict:
    """What the accuracy record keeps of an estimate."""
    return {key: estimate[key] for key in ("computed_at", "p50", "p90")}


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
    assert waiting.estimate_samples == [sample(estimate)]

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
    assert waiting.estimate_samples == [sample(estimate)]
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


def test_a_waiting_task_keeps_its_first_estimate_then_one_an_hour_and_nothing_it_could_not_predict(world):
    acme = world.tenants["acme"]
    node = make_node("n1", gpus=8)
    running_on(node, acme, range(8), 6 * 3600)
    waiting = make_task(acme, name="big", gpu_required=8)
    absent = make_task(acme, name="amd", gpu_required=1, gpu_type="amd")
    start = utcnow()
    for minutes in (0, 30, 59, 61, 90, 125):  # runs every 30 s in life; here at these moments
        predict(now=start + timedelta(minutes=minutes))
    waiting.refresh_from_db()
    kept = [at(row["computed_at"]) for row in waiting.estimate_samples]
    assert kept == [start, start + timedelta(minutes=61), start + timedelta(minutes=125)]
    assert all(set(row) == {"computed_at", "p50", "p90"} for row in waiting.estimate_samples)
    absent.refresh_from_db()
    assert absent.estimated_start["p50"] is None and absent.estimate_samples is None


def started_after(tenant, waited: timedelta, estimates: list[tuple[timedelta, timedelta]], **fields):
    """A task that started now after waiting `waited`, having kept estimates made at each
    (moment after submission, predicted start after submission)."""
    now = utcnow()
    submitted = now - waited
    task = make_task(tenant, status="running", started_at=now, **fields)
    Task.objects.filter(pk=task.pk).update(
        created_at=submitted,
        estimate_samples=[
            {"computed_at": (submitted + made).isoformat(), "p50": (submitted + p50).isoformat(), "p90": None}
            for made, p50 in estimates
        ],
    )
    return task


def test_the_accuracy_report_groups_the_errors_by_how_far_ahead_and_operators_alone_read_it(api, client, world):
    acme = world.tenants["acme"]
    hour, minute = timedelta(hours=1), timedelta(minutes=1)
    # waited 3 h: at submission (3 h ahead) said 4 h, 1 h off; after 1 h (2 h ahead) said
    # 2.5 h, 30 min off; after 110 min (70 min ahead) right on time
    started_after(acme, 3 * hour, [(0 * hour, 4 * hour), (hour, 2.5 * hour), (110 * minute, 3 * hour)])
    # waited 20 min, said 30: 10 min off, made 20 min ahead
    started_after(acme, 20 * minute, [(0 * hour, 30 * minute)])
    # waited 90 min, on time
    started_after(acme, 90 * minute, [(0 * hour, 90 * minute)])
    # waited 5 min, on time: not a long wait, so not in "at submission"
    started_after(acme, 5 * minute, [(0 * hour, 5 * minute)])
    # a gang counts once, by its rank 0: said 9 h for a start now
    group = make_group(acme, workers=2, gpus=1)
    now = utcnow()
    Task.objects.filter(group=group).update(
        status="running",
        started_at=now,
        estimate_samples=[{"computed_at": now.isoformat(), "p50": (now + 9 * hour).isoformat(), "p90": None}],
    )
    # nothing from a task that started with no estimate, nor from one outside the window
    make_task(acme, status="running", started_at=now)
    old = started_after(acme, hour, [(0 * hour, 2 * hour)])
    Task.objects.filter(pk=old.pk).update(started_at=now - timedelta(days=40))

    assert api.get("/api/v1/admin/predictions/accuracy", **bearer(world.keys["acme-admin"])).status_code == 403
    key = bearer(world.operator_key)
    report = api.get("/api/v1/admin/predictions/accuracy?days=30", **key).json()
    bands = {band["lead"]: band for band in report["bands"]}
    assert list(bands) == ["under 10 minutes", "10 minutes to 1 hour", "1 to 6 hours", "6 to 24 hours", "over 24 hours"]
    # the 5-minute wait on time, the gang's rank 0 9 h off
    assert bands["under 10 minutes"]["estimates"] == 2
    assert bands["under 10 minutes"]["median_error_seconds"] == pytest.approx(9 * 3600 / 2, abs=2)
    assert bands["10 minutes to 1 hour"]["estimates"] == 1
    assert bands["10 minutes to 1 hour"]["median_error_seconds"] == pytest.approx(600, abs=2)
    assert bands["10 minutes to 1 hour"]["median_relative_error"] == pytest.approx(0.5, abs=0.01)  # of 20 min left
    # 1 h, 30 min, 0 and 0 off
    assert bands["1 to 6 hours"]["estimates"] == 4
    assert bands["1 to 6 hours"]["median_error_seconds"] == pytest.approx(900, abs=2)
    assert bands["over 24 hours"] == {
        "lead": "over 24 hours",
        "from_seconds": 86400,
        "to_seconds": None,
        "estimates": 0,
        "median_error_seconds": None,
        "p90_error_seconds": None,
        "median_relative_error": None,
    }
    # the first estimates of the waits over 10 minutes: 1 h of 3 h off, 10 of 20 min, 0 of 90 min
    first = report["at_submission"]
    assert first["estimates"] == 3 and first["min_wait_seconds"] == 600
    assert first["median_error_seconds"] == pytest.approx(600, abs=2)
    assert first["median_relative_error"] == pytest.approx(1 / 3, abs=0.01)

    bad = api.get("/api/v1/admin/predictions/accuracy?days=0&colour=red", **key)
    assert bad.status_code == 400 and {"days", "colour"} <= set(bad.json()["error"]["fields"])

    page = signed_in(client, world.operator).get("/portal/queues/estimates/")
    html = page.content.decode()
    assert page.status_code == 200
    assert 'data-accuracy="10 minutes to 1 hour"><td>10 minutes to 1 hour</td><td>1</td><td>10 min</td>' in html
    assert "off by 10 min at the median, 33 % of their wait" in html
    assert signed_in(client, world.users["acme-member"]).get("/portal/queues/estimates/").status_code == 403
