"""The image channel's janitor (docs/images.md): a pull is stalled only after 10 minutes
without progress, never for its total time; past its 2-hour budget it is over budget; a
pending request of a node offline for more than 10 minutes fails; finished requests past
the retention are deleted. Time is passed in, never slept."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings

from apps.core.clock import utcnow
from apps.core.guard import Outcome
from apps.nodes import images
from apps.nodes.jobs import image_janitor_job
from apps.nodes.models import ImageRequest
from tests.factories import make_node
from tests.headers import AGENT
from tests.nodes.image_support import claim, progress, report

pytestmark = pytest.mark.django_db


@pytest.fixture
def node():
    return make_node("jan-1", 1)


def processing(node, *, claimed_ago: timedelta, progress_ago: timedelta | None = None, created_ago=None):
    now = utcnow()
    row = images.request_pull(node, f"hf/x:{ImageRequest.objects.count()}")
    created = now - (created_ago or claimed_ago)
    ImageRequest.objects.filter(pk=row.pk).update(
        status="processing",
        created_at=created,
        deadline=created + timedelta(hours=2),
        claimed_at=now - claimed_ago,
        progress_at=None if progress_ago is None else now - progress_ago,
    )
    return row.pk


def status(pk):
    return ImageRequest.objects.values_list("status", "error").get(pk=pk)


def test_stalled_after_ten_minutes_without_progress_never_for_its_total_time(node):
    slow = processing(node, claimed_ago=timedelta(minutes=100), progress_ago=timedelta(seconds=50))
    quiet = processing(node, claimed_ago=timedelta(minutes=30), progress_ago=timedelta(minutes=11))
    never = processing(node, claimed_ago=timedelta(minutes=11))
    fresh = processing(node, claimed_ago=timedelta(minutes=9))
    counts = images.sweep_image_requests()
    assert counts["stalled"] == 2
    assert status(slow) == ("processing", "")
    assert status(fresh) == ("processing", "")
    for pk in (quiet, never):
        assert status(pk) == ("failed", "stalled: no progress for 10 minutes")
        assert ImageRequest.objects.get(pk=pk).finished_at is not None


def test_a_pull_reporting_progress_every_minute_survives_for_its_whole_budget(api, node):
    row = images.request_pull(node, "hf/big:1")
    assert report(api, row.pk, claim(node.pk)).status_code == 200
    start = utcnow()
    for minute in range(0, 115, 9):  # the agent's reports (apart by under 10 minutes) for nearly 2 hours
        ImageRequest.objects.filter(pk=row.pk).update(progress_at=start + timedelta(minutes=minute))
        assert images.sweep_image_requests(now=start + timedelta(minutes=minute + 8))["stalled"] == 0
    assert status(row.pk)[0] == "processing"
    # its progress through the API moves progress_at
    before = utcnow() - timedelta(minutes=5)
    ImageRequest.objects.filter(pk=row.pk).update(progress_at=before)
    assert report(api, row.pk, progress(node.pk, 3, 4)).status_code == 200
    assert ImageRequest.objects.get(pk=row.pk).progress_at > before


def test_over_budget_after_two_hours_even_with_progress(node):
    over = processing(node, claimed_ago=timedelta(minutes=125), progress_ago=timedelta(seconds=30))
    pending = images.request_pull(node, "hf/never-claimed:1")
    ImageRequest.objects.filter(pk=pending.pk).update(deadline=utcnow() - timedelta(seconds=1))
    within = processing(node, claimed_ago=timedelta(minutes=119), progress_ago=timedelta(seconds=30))
    counts = images.sweep_image_requests()
    assert counts["over_budget"] == 2
    assert status(over) == ("failed", "over budget: not finished within 2 hours")
    assert status(pending.pk)[0] == "failed"
    assert status(within) == ("processing", "")


def test_a_report_after_the_janitor_closed_the_request_learns_it_lost(api, node):
    pk = processing(node, claimed_ago=timedelta(minutes=20))
    images.sweep_image_requests()
    answer = report(api, pk, progress(node.pk))
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "status_changed"
    assert status(pk)[0] == "failed"


def test_a_pending_request_of_a_node_offline_for_more_than_ten_minutes_fails(node):
    gone = make_node("jan-gone", 1)
    waiting = images.request_pull(gone, "hf/x:1")
    recent = images.request_pull(node, "hf/x:1")
    away = make_node("jan-away", 1)
    briefly = images.request_pull(away, "hf/x:1")
    now = utcnow()
    # gone: silent 12 minutes (offline for 11); away: silent 5 minutes (offline for 4)
    type(gone).objects.filter(pk="jan-gone").update(status="offline", last_heartbeat_at=now - timedelta(minutes=12))
    type(away).objects.filter(pk="jan-away").update(status="offline", last_heartbeat_at=now - timedelta(minutes=5))
    counts = images.sweep_image_requests(now=now)
    assert counts["node_offline"] == 1
    assert status(waiting.pk)[0] == "failed" and "offline" in status(waiting.pk)[1]
    assert status(recent.pk)[0] == "pending" and status(briefly.pk)[0] == "pending"


def test_a_node_that_signed_off_long_ago_counts_as_offline(node):
    row = images.request_pull(node, "hf/x:1")
    now = utcnow()
    type(node).objects.filter(pk=node.pk).update(
        last_heartbeat_at=now - timedelta(minutes=11), signed_off_at=now - timedelta(minutes=11)
    )
    assert images.sweep_image_requests(now=now)["node_offline"] == 1
    assert status(row.pk)[0] == "failed"


@override_settings(HETEROFLOW_IMAGE_REQUEST_RETENTION_DAYS=7)
def test_finished_requests_older_than_the_retention_are_pruned(node, monkeypatch):
    monkeypatch.setattr(images, "PRUNE_BATCH", 2)  # several bounded batches
    now = utcnow()
    old = [images.request_pull(node, f"hf/old:{i}").pk for i in range(5)]
    ImageRequest.objects.filter(pk__in=old).update(status="completed", finished_at=now - timedelta(days=8))
    kept = images.request_pull(node, "hf/kept:1").pk
    ImageRequest.objects.filter(pk=kept).update(status="failed", finished_at=now - timedelta(days=6))
    open_old = images.request_pull(node, "hf/open:1").pk  # open rows are never pruned, however old
    ImageRequest.objects.filter(pk=open_old).update(
        created_at=now - timedelta(days=30), deadline=now + timedelta(hours=1)
    )
    assert images.sweep_image_requests(now=now)["pruned"] == 5
    assert set(ImageRequest.objects.values_list("pk", flat=True)) == {kept, open_old}


def test_the_janitor_is_a_guarded_periodic_job(node):
    pk = processing(node, claimed_ago=timedelta(minutes=20))
    assert image_janitor_job(immediate=True) == Outcome.RAN
    assert status(pk)[0] == "failed"
    assert image_janitor_job() == Outcome.EARLY  # the guard keeps it to once a minute


def test_the_agent_sees_the_janitors_verdict(api, node):
    pk = processing(node, claimed_ago=timedelta(minutes=20))
    images.sweep_image_requests()
    answer = api.get(f"/api/v1/agent/image-requests?node_id={node.pk}&status=failed", **AGENT).json()
    assert [r["id"] for r in answer["results"]] == [pk]
