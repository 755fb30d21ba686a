"""The orphan GC (slices.gc, every 60 s): slices whose task ended are given back; MIG
instances a node reports that no live slice owns get an orphaned row and a destroy
request; nothing a live slice owns is destroyed, and a card with a create in flight is
left alone (docs/slices.md)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection

from apps.core.clock import utcnow
from apps.core.guard import Outcome
from apps.nodes.models import Node
from apps.slices import services
from apps.slices.jobs import gc_job
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


def report_instances(node, card: int, instances: list[dict]) -> None:
    """What the heartbeat leaves in gpu_capabilities for a card in MIG mode."""
    caps = dict(Node.objects.get(pk=node.pk).gpu_capabilities or {})
    caps[str(card)] = {"mig_capable": True, "mps_capable": False, "best_tier": 1, "mig_instances": instances}
    Node.objects.filter(pk=node.pk).update(gpu_capabilities=caps)


def instance(uuid: str, gi: int, ci: int = 0, profile: str = "1g.18gb") -> dict:
    return {"uuid": uuid, "gi": gi, "ci": ci, "profile": profile}


def destroys() -> list[SliceRequest]:
    return list(SliceRequest.objects.filter(action="destroy").order_by("pk"))


def test_an_instance_no_slice_owns_gets_an_orphaned_row_and_a_destroy(node):
    report_instances(node, 1, [instance("MIG-lost-1", 7, 0, "2g.35gb")])
    report = services.gc()
    (orphan,) = Slice.objects.filter(state="orphaned")
    assert report.orphans == [orphan.pk]
    assert (orphan.node_id, orphan.gpu_index, orphan.task_id, orphan.tenant_id) == ("mig-node", 1, None, None)
    assert (orphan.device_id, orphan.handles, orphan.profile) == ("MIG-lost-1", {"gi": 7, "ci": 0}, "2g.35gb")
    assert orphan.memory_mb == 35 * 1024
    (destroy,) = destroys()
    assert (destroy.slice_id, destroy.vendor, destroy.status) == (orphan.pk, "nvidia-mig", "pending")
    assert destroy.params["device_id"] == "MIG-lost-1" and destroy.params["handles"] == {"gi": 7, "ci": 0}
    # again: the orphan's own row owns the instance now, nothing more is made
    services.gc()
    assert Slice.objects.filter(state="orphaned").count() == 1 and len(destroys()) == 1


def test_an_instance_a_live_slice_owns_is_never_destroyed(node, acme):
    by_uuid = make_bound_slice(node, acme, state="confirmed")
    Slice.objects.filter(pk=by_uuid.pk).update(device_id="MIG-live-1", handles={"gi": 1, "ci": 0})
    by_handles = make_bound_slice(node, acme, state="confirmed")
    Slice.objects.filter(pk=by_handles.pk).update(device_id="", handles={"gi": 2, "ci": 0})
    going = make_slice(node, acme, state="releasing", device_id="MIG-going", handles={"gi": 3, "ci": 0})
    make_slice_request(going, "destroy", status="processing")
    report_instances(node, 0, [instance("MIG-live-1", 1), instance("MIG-other-uuid", 2), instance("MIG-going", 3)])
    report = services.gc()
    assert report.orphans == []
    assert not Slice.objects.filter(state="orphaned").exists()
    assert [r.slice_id for r in destroys()] == [going.pk]  # only the one it already had


def test_a_gpu_instance_without_its_compute_instance_is_owned_by_its_gi(node, acme):
    """A partial create left a GPU instance (no CI, no UUID yet): its orphaned slice holds
    {"gi": 6}; the beat lists it without ci or uuid. It is not orphaned a second time."""
    partial = make_slice(node, acme, state="orphaned", device_id="", handles={"gi": 6})
    make_slice_request(partial, "destroy", status="failed", finished_at=utcnow())
    report_instances(node, 0, [{"gi": 6, "profile": "1g.18gb"}, {"gi": 8}])
    report = services.gc()
    (new,) = Slice.objects.filter(pk__in=report.orphans)
    assert new.handles == {"gi": 8} and new.device_id == ""
    assert services.gc().orphans == []


@pytest.mark.parametrize(
    "status, finished_ago, skipped",
    [("processing", None, True), ("completed", 10, True), ("completed", 31, False), ("failed", 5, False)],
)
def test_a_card_with_a_create_in_flight_is_skipped(node, acme, status, finished_ago, skipped):
    now = utcnow()
    creating = make_bound_slice(node, acme, state="issued" if status == "processing" else "requested")
    SliceRequest.objects.filter(slice=creating).update(
        status=status, finished_at=None if finished_ago is None else now - timedelta(seconds=finished_ago)
    )
    if status != "processing":  # the slice moved on with its report (confirmed or failed)
        Slice.objects.filter(pk=creating.pk).update(state="confirmed" if status == "completed" else "failed")
    report_instances(node, 0, [instance("MIG-new-or-lost", 4)])
    report_instances(node, 1, [instance("MIG-lost-elsewhere", 5)])
    report = services.gc(now=now)
    orphaned = set(Slice.objects.filter(state="orphaned").values_list("device_id", flat=True))
    assert "MIG-lost-elsewhere" in orphaned  # another card is not held back
    assert ("MIG-new-or-lost" not in orphaned) is skipped
    assert (("mig-node", 0) in report.skipped_cards) is skipped


def test_an_instance_destroyed_moments_ago_but_still_in_the_beat_is_not_orphaned_again(node, acme):
    now = utcnow()
    gone = make_slice(node, acme, state="released", device_id="MIG-just-gone", handles={"gi": 4, "ci": 0})
    make_slice_request(gone, "destroy", status="completed", finished_at=now - timedelta(seconds=5))
    report_instances(node, 0, [instance("MIG-just-gone", 4)])  # the beat was sent before the destroy
    assert services.gc(now=now).orphans == []
    assert services.gc(now=now + timedelta(seconds=31)).orphans != []  # still there after the settle time


def test_absent_or_empty_instance_lists_make_nothing(node):
    Node.objects.filter(pk=node.pk).update(gpu_capabilities={"0": {"mig_capable": True}, "1": {"mig_instances": []}})
    assert services.gc().orphans == []
    assert not Slice.objects.exists()


def test_a_slice_whose_task_ended_behind_the_hooks_back_is_given_back(node, acme):
    confirmed = make_bound_slice(node, acme, state="confirmed", device_id="MIG-done", handles={"gi": 1, "ci": 0})
    software = make_bound_slice(node, acme, card=1, state="confirmed", tier="software", profile="")
    requested = make_bound_slice(node, acme, card=1, state="requested")
    with connection.cursor() as cursor:  # ended without move_tasks (and so without its release)
        cursor.execute(
            "UPDATE tasks SET status = 'completed', node_id = NULL WHERE id = ANY(%s)",
            [[confirmed.task_id, software.task_id, requested.task_id]],
        )
    report = services.gc()
    assert report.released_for_tasks == 3
    states = dict(Slice.objects.values_list("pk", "state"))
    assert states[confirmed.pk] == "releasing" and states[software.pk] == "released"
    assert states[requested.pk] == "failed"
    assert [r.slice_id for r in destroys()] == [confirmed.pk]
    assert SliceRequest.objects.get(slice=requested).status == "failed"  # its create withdrawn
    services.gc()  # idempotent
    assert dict(Slice.objects.values_list("pk", "state")) == states and len(destroys()) == 1


def test_a_slice_whose_task_was_deleted_is_given_back(node, acme):
    confirmed = make_bound_slice(node, acme, state="confirmed", device_id="MIG-gone", handles={"gi": 1, "ci": 0})
    issued = make_bound_slice(node, acme, card=1, state="issued")
    Task.objects.filter(pk__in=[confirmed.task_id, issued.task_id]).delete()  # task → null (SET_NULL)
    report = services.gc()
    assert report.released_taskless == 2
    confirmed.refresh_from_db()
    issued.refresh_from_db()
    assert confirmed.state == "releasing" and [r.slice_id for r in destroys()] == [confirmed.pk]
    assert issued.state == "releasing"  # its create reports first, then it is undone


def test_a_live_task_keeps_its_slice(node, acme):
    slice_ = make_bound_slice(node, acme, state="confirmed", device_id="MIG-keep", handles={"gi": 1, "ci": 0})
    Task.objects.filter(pk=slice_.task_id).update(status="running")
    report_instances(node, 0, [instance("MIG-keep", 1)])
    services.gc()
    slice_.refresh_from_db()
    assert slice_.state == "confirmed" and not destroys()


def test_the_job_runs_under_its_guard(node):
    report_instances(node, 0, [instance("MIG-by-the-job", 6)])
    assert gc_job(immediate=True) == Outcome.RAN
    assert Slice.objects.filter(state="orphaned", device_id="MIG-by-the-job").exists()
    assert gc_job() == Outcome.EARLY  # within its period
