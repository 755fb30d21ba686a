"""The compensation scan (slices.compensate, every 60 s, under its own advisory lock
9603): requests past their deadline time out with their consequences, half-done
transitions a crash left are finished, releasing slices get their destroy again (with a
back-off after a failure), and running it twice changes nothing more (docs/slices.md)."""

from __future__ import annotations

import json
from datetime import timedelta

import psycopg
import pytest
from django.db import connection

from apps.core.clock import utcnow
from apps.core.guard import Outcome
from apps.core.locks import lock_id
from apps.scheduler.models import GpuAllocation
from apps.slices import services
from apps.slices.jobs import compensate_job
from apps.slices.models import Slice, SliceRequest
from apps.tasks.models import Task
from tests.factories import make_bound_slice, make_node, make_slice, make_slice_request

pytestmark = pytest.mark.django_db


@pytest.fixture
def acme(world):
    return world.tenants["acme"]


@pytest.fixture
def node():
    return make_node("mig-node", 2, model="NVIDIA H200", memory_total_mb=143771)


def later(seconds: int):
    return utcnow() + timedelta(seconds=seconds)


def state_of(slice_) -> str:
    return Slice.objects.get(pk=slice_.pk).state


def requests_of(slice_) -> list[tuple[str, str]]:
    return list(slice_.requests.order_by("pk").values_list("action", "status"))


def test_a_create_past_its_deadline_times_out_and_its_task_goes_back_to_the_queue(node, acme):
    slice_ = make_bound_slice(node, acme, state="issued")
    assert services.compensate(now=later(60)).timed_out == []  # within the deadline
    report = services.compensate(now=later(121))
    (request,) = slice_.requests.all()
    assert report.timed_out == [request.pk] and request.status == "timed_out"
    assert state_of(slice_) == "failed"
    task = Task.objects.get(pk=slice_.task_id)
    assert task.status == "pending" and task.schedule_reason["code"] == "SliceFailed"
    assert "120 s" in task.schedule_reason["message"]
    assert not GpuAllocation.objects.filter(task=task).exists()
    assert services.compensate(now=later(122)).as_dict() == services.ScanReport().as_dict()


def test_a_timed_out_destroy_is_issued_again_after_the_back_off(node, acme):
    slice_ = make_slice(node, acme, state="releasing", device_id="MIG-slow", handles={"gi": 1, "ci": 0})
    now = utcnow()
    make_slice_request(slice_, "destroy", status="processing", claimed_at=now, deadline=now + timedelta(seconds=120))
    services.compensate(now=now + timedelta(seconds=121))
    assert requests_of(slice_) == [("destroy", "timed_out")]
    assert state_of(slice_) == "releasing"
    assert services.compensate(now=now + timedelta(seconds=150)).destroys == []  # backing off
    assert services.compensate(now=now + timedelta(seconds=182)).destroys == [slice_.pk]
    assert requests_of(slice_) == [("destroy", "timed_out"), ("destroy", "pending")]
    assert services.compensate(now=now + timedelta(seconds=400)).destroys == []  # one open at a time


def test_the_back_off_doubles_with_each_failed_destroy(node, acme):
    slice_ = make_slice(node, None, state="orphaned", device_id="MIG-busy", handles={"gi": 2, "ci": 0})
    now = utcnow()
    for ago in (300, 200):
        finished = now - timedelta(seconds=ago)
        make_slice_request(slice_, "destroy", status="failed", error="In use", finished_at=finished)
    # two failures: 120 s after the last (200 s ago: due); one more makes it 240 s
    assert services.compensate(now=now).destroys == [slice_.pk]
    SliceRequest.objects.filter(slice=slice_, status="pending").update(status="failed", finished_at=now)
    assert services.compensate(now=now + timedelta(seconds=200)).destroys == []
    assert services.compensate(now=now + timedelta(seconds=241)).destroys == [slice_.pk]


def test_a_report_whose_slice_update_did_not_happen_is_applied_by_the_scan(node, acme):
    created = make_bound_slice(node, acme, state="issued")
    refused = make_bound_slice(node, acme, card=1, state="issued")
    destroyed = make_slice(node, acme, state="releasing", device_id="MIG-old", handles={"gi": 3, "ci": 0})
    make_slice_request(destroyed, "destroy", status="processing")
    # the agent's reports were written, and then the process died before the slices moved
    result = {"created": [{"uuid": "MIG-new", "gi": 1, "ci": 0}], "device_id": "MIG-new", "handles": {"gi": 1, "ci": 0}}
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE slice_requests SET status = 'completed', result = %s::jsonb, finished_at = now() "
            "WHERE slice_id = ANY(%s)",
            [json.dumps(result), [created.pk, destroyed.pk]],
        )
        cursor.execute(
            "UPDATE slice_requests SET status = 'failed', error = 'No space', finished_at = now() WHERE slice_id = %s",
            [refused.pk],
        )
    report = services.compensate()
    assert len(report.reapplied) == 3
    created.refresh_from_db()
    assert (created.state, created.device_id, created.handles) == ("confirmed", "MIG-new", {"gi": 1, "ci": 0})
    assert state_of(destroyed) == "released"
    assert state_of(refused) == "failed"
    task = Task.objects.get(pk=refused.task_id)
    assert task.status == "pending" and task.schedule_reason["code"] == "SliceFailed"
    assert services.compensate().as_dict() == services.ScanReport().as_dict()  # converged


def test_a_task_ended_behind_the_hooks_back_converges_through_the_gc_and_the_scan(node, acme):
    slice_ = make_bound_slice(node, acme, state="confirmed", device_id="MIG-t", handles={"gi": 1, "ci": 0})
    with connection.cursor() as cursor:
        cursor.execute("UPDATE tasks SET status = 'failed', node_id = NULL WHERE id = %s", [slice_.task_id])
    services.gc()
    assert state_of(slice_) == "releasing" and requests_of(slice_) == [("destroy", "pending")]
    # the agent claims the destroy and dies: the scan times it out and issues it again
    destroy = slice_.requests.get()
    services.claim(destroy)
    services.compensate(now=later(121))
    services.compensate(now=later(121 + 61))
    assert requests_of(slice_) == [("destroy", "timed_out"), ("destroy", "pending")]
    again = slice_.requests.get(status="pending")
    services.claim(again)
    services.report(again, status="completed", result={"destroyed": [{"uuid": "MIG-t", "gi": 1, "ci": 0}]})
    assert state_of(slice_) == "released"
    for _ in range(2):  # nothing more to do, however often it runs
        assert services.gc().orphans == []
        assert services.compensate(now=later(600)).as_dict() == services.ScanReport().as_dict()
    assert slice_.requests.count() == 2


def test_a_releasing_slice_left_without_its_destroy_gets_one(node, acme):
    """release_for_tasks marked it releasing; the destroy's insert did not happen."""
    mig = make_slice(node, acme, state="releasing", device_id="MIG-r", handles={"gi": 1, "ci": 0})
    mps = make_slice(node, acme, gpu_index=1, state="releasing", tier="mps", profile="")
    report = services.compensate()
    assert report.destroys == [mig.pk] and report.released == [mps.pk]
    assert requests_of(mig) == [("destroy", "pending")] and state_of(mps) == "released"
    assert services.compensate().as_dict() == services.ScanReport().as_dict()


def test_a_released_slice_with_a_completed_destroy_is_left_alone(node, acme):
    slice_ = make_slice(node, acme, state="released", device_id="MIG-x", handles={"gi": 1, "ci": 0})
    make_slice_request(slice_, "destroy", status="completed", finished_at=utcnow())
    assert services.compensate().as_dict() == services.ScanReport().as_dict()


def test_the_scan_has_its_own_advisory_lock(node, acme, settings):
    make_slice(node, acme, state="releasing", device_id="MIG-l", handles={"gi": 1, "ci": 0})
    db = connection.settings_dict
    other = psycopg.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], password=db["PASSWORD"] or None, dbname=db["NAME"]
    )
    try:
        other.execute("SELECT pg_advisory_lock(%s)", [lock_id(services.COMPENSATION_LOCK)])
        assert services.compensate().busy
        assert not SliceRequest.objects.exists()
        other.execute("SELECT pg_advisory_unlock(%s)", [lock_id(services.COMPENSATION_LOCK)])  # at once, not on exit
    finally:
        other.close()
    assert services.compensate().destroys != []
    assert "9603" in services.COMPENSATION_LOCK


def test_the_job_runs_under_its_guard(node, acme):
    slice_ = make_bound_slice(node, acme, state="issued")
    SliceRequest.objects.filter(slice=slice_).update(deadline=utcnow() - timedelta(seconds=1))
    assert compensate_job(immediate=True) == Outcome.RAN
    assert state_of(slice_) == "failed"
