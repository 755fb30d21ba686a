"""The agent's slice command channel (docs/slices.md): the poll, the claim and the reports
by CAS, partial outcomes, and the bodies refused (strict, nothing written)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.scheduler.models import GpuAllocation
from apps.slices import services
from apps.slices.models import Slice, SliceRequest
from apps.tasks.models import Task
from tests.factories import make_bound_slice, make_node, make_slice, make_slice_request
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db

LIST = "/api/v1/agent/slice-requests"


def url(request) -> str:
    return f"{LIST}/{request.pk}"


def claim_body(node_id="n1"):
    return {"node_id": node_id, "from_status": "pending", "status": "processing"}


def report_body(status="completed", node_id="n1", **extra):
    return {"node_id": node_id, "from_status": "processing", "status": status, **extra}


@pytest.fixture
def node():
    return make_node("n1", 2, model="NVIDIA H200", memory_total_mb=143771)


@pytest.fixture
def acme(world):
    return world.tenants["acme"]


def only_request(slice_) -> SliceRequest:
    return slice_.requests.order_by("-pk").first()


# --- the poll ---------------------------------------------------------------------------------


def test_the_poll_hands_out_at_most_five_of_the_node_oldest_first(api, node, acme):
    other = make_node("n2", 1)
    slices = [make_bound_slice(node, acme, card=i % 2) for i in range(7)]
    make_bound_slice(other, acme)
    answer = api.get(LIST, {"node_id": "n1", "status": "pending"}, **AGENT)
    assert answer.status_code == 200, answer.content
    results = answer.json()["results"]
    assert [r["slice_id"] for r in results] == [s.pk for s in slices[:5]]
    first = results[0]
    assert set(first) >= {"id", "node_id", "slice_id", "action", "vendor", "params", "status", "created_at"}
    assert first["action"] == "create" and first["vendor"] == "nvidia-mig" and first["node_id"] == "n1"
    assert first["params"]["profile"] == "1g.18gb" and first["params"]["gpu_index"] == 0


def test_the_poll_needs_the_node_and_the_status_and_the_agent_key(api, node, world):
    answer = api.get(LIST, **AGENT)
    assert answer.status_code == 400
    assert set(answer.json()["error"]["fields"]) == {"node_id", "status"}
    assert api.get(LIST, {"node_id": "n1", "status": "pending", "bogus": "1"}, **AGENT).status_code == 400
    people = api.get(LIST, {"node_id": "n1", "status": "pending"}, **bearer(world.keys["acme-admin"]))
    assert people.status_code == 403
    assert api.get(LIST, {"node_id": "n1", "status": "pending"}, **bearer(world.operator_key)).status_code == 403


# --- the claim --------------------------------------------------------------------------------


def test_a_claim_moves_the_request_to_processing_with_a_deadline_and_the_slice_to_issued(api, node, acme):
    slice_ = make_bound_slice(node, acme)
    request = only_request(slice_)
    before = utcnow()
    answer = api.put(url(request), claim_body(), format="json", **AGENT)
    assert answer.status_code == 200, answer.content
    assert answer.json()["status"] == "processing"
    request.refresh_from_db()
    slice_.refresh_from_db()
    assert request.status == "processing" and request.claimed_at >= before
    assert request.deadline == request.claimed_at + timedelta(seconds=120)
    assert slice_.state == "issued"
    again = api.put(url(request), claim_body(), format="json", **AGENT)
    assert again.status_code == 409
    assert "processing" in again.json()["error"]["message"]


def test_another_nodes_request_is_404_and_a_withdrawn_one_409(api, node, acme):
    other = make_node("n2", 1)
    theirs = only_request(make_bound_slice(other, acme))
    assert api.put(url(theirs), claim_body(), format="json", **AGENT).status_code == 404
    assert SliceRequest.objects.get(pk=theirs.pk).status == "pending"
    mine = make_bound_slice(node, acme)
    Task.objects.filter(pk=mine.task_id).update(status="cancelled")  # ended before the claim …
    from_ledger = services.ledger.release_for_tasks([mine.task_id], utcnow())  # … by move_tasks' hook
    assert from_ledger == 1
    answer = api.put(url(only_request(mine)), claim_body(), format="json", **AGENT)
    assert answer.status_code == 409 and "failed" in answer.json()["error"]["message"]


# --- reports ----------------------------------------------------------------------------------


def test_a_completed_create_confirms_the_slice_with_its_device(api, node, acme):
    slice_ = make_bound_slice(node, acme, state="issued")
    result = {"created": [{"uuid": "MIG-aaaa", "gi": 1, "ci": 0, "profile": "1g.18gb"}], "device_id": "MIG-aaaa"}
    result["handles"] = {"gi": 1, "ci": 0}
    answer = api.put(url(only_request(slice_)), report_body(result=result), format="json", **AGENT)
    assert answer.status_code == 200, answer.content
    slice_.refresh_from_db()
    assert (slice_.state, slice_.device_id, slice_.handles) == ("confirmed", "MIG-aaaa", {"gi": 1, "ci": 0})
    assert slice_.confirmed_at is not None
    retried = api.put(url(only_request(slice_)), report_body(result=result), format="json", **AGENT)
    assert retried.status_code == 409 and "completed" in retried.json()["error"]["message"]


def test_a_mig_create_completed_without_a_mig_device_is_not_confirmed(api, node, acme):
    slice_ = make_bound_slice(node, acme, state="issued")
    assert api.put(url(only_request(slice_)), report_body(result={}), format="json", **AGENT).status_code == 200
    slice_.refresh_from_db()
    assert slice_.state == "failed" and "no MIG device" in slice_.error
    assert Task.objects.get(pk=slice_.task_id).schedule_reason["code"] == "SliceFailed"


def test_an_mps_create_completed_is_confirmed_on_the_card(api, node, acme):
    slice_ = make_bound_slice(node, acme, state="issued", tier="mps", profile="", compute_percent=12)
    assert api.put(url(only_request(slice_)), report_body(result={}), format="json", **AGENT).status_code == 200
    slice_.refresh_from_db()
    assert (slice_.state, slice_.device_id) == ("confirmed", slice_.gpu_uuid)


def test_a_create_completed_after_its_task_ended_is_destroyed_at_once(api, node, acme):
    slice_ = make_bound_slice(node, acme, state="issued")
    create = only_request(slice_)
    Slice.objects.filter(pk=slice_.pk).update(state="releasing")  # release_for_tasks on an issued slice
    result = {
        "created": [{"uuid": "MIG-bbbb", "gi": 2, "ci": 0}],
        "device_id": "MIG-bbbb",
        "handles": {"gi": 2, "ci": 0},
    }
    assert api.put(url(create), report_body(result=result), format="json", **AGENT).status_code == 200
    slice_.refresh_from_db()
    assert slice_.state == "releasing" and slice_.device_id == "MIG-bbbb"
    destroy = only_request(slice_)
    assert (destroy.action, destroy.status) == ("destroy", "pending")
    assert destroy.params["device_id"] == "MIG-bbbb" and destroy.params["handles"] == {"gi": 2, "ci": 0}


def test_an_mps_create_completed_after_its_task_ended_is_released(api, node, acme):
    slice_ = make_bound_slice(node, acme, state="issued", tier="mps", profile="", compute_percent=12)
    Slice.objects.filter(pk=slice_.pk).update(state="releasing")
    assert api.put(url(only_request(slice_)), report_body(result={}), format="json", **AGENT).status_code == 200
    slice_.refresh_from_db()
    assert slice_.state == "released" and slice_.requests.count() == 1


def test_a_failed_create_with_nothing_made_fails_the_slice_and_requeues_the_task(api, node, acme):
    slice_ = make_bound_slice(node, acme, state="issued")
    body = report_body("failed", result={"created": []}, error="Insufficient Resources")
    assert api.put(url(only_request(slice_)), body, format="json", **AGENT).status_code == 200
    slice_.refresh_from_db()
    task = Task.objects.get(pk=slice_.task_id)
    assert slice_.state == "failed" and "Insufficient Resources" in slice_.error
    assert task.status == "pending" and task.node_id is None
    assert task.schedule_reason["code"] == "SliceFailed"
    assert "Insufficient Resources" in task.schedule_reason["message"]
    assert not GpuAllocation.objects.filter(task=task).exists()  # move_tasks gave the card back
    assert task.events.filter(kind="requeued").exists()
    assert slice_.requests.count() == 1  # nothing on the card: nothing to destroy


def test_a_partial_create_orphans_what_it_made_with_a_destroy_and_requeues_the_task(api, node, acme):
    slice_ = make_bound_slice(node, acme, state="issued")
    made = [{"uuid": "MIG-c1", "gi": 3, "ci": 0, "profile": "1g.18gb"}, {"uuid": "MIG-c2", "gi": 4, "ci": 0}]
    body = report_body("failed", result={"created": made}, error="3 of 4 made; then: No space left")
    assert api.put(url(only_request(slice_)), body, format="json", **AGENT).status_code == 200
    slice_.refresh_from_db()
    assert (slice_.state, slice_.device_id, slice_.handles) == ("orphaned", "MIG-c1", {"gi": 3, "ci": 0})
    destroy = only_request(slice_)
    assert (destroy.action, destroy.status, destroy.params["handles"]) == ("destroy", "pending", {"gi": 3, "ci": 0})
    (second,) = Slice.objects.exclude(pk=slice_.pk)  # one instance per slice, as the agent destroys them
    assert (second.state, second.device_id, second.handles, second.task_id) == (
        "orphaned",
        "MIG-c2",
        {"gi": 4, "ci": 0},
        None,
    )
    assert second.tenant_id == slice_.tenant_id and only_request(second).action == "destroy"
    task = Task.objects.get(pk=slice_.task_id)
    assert task.status == "pending" and task.schedule_reason["code"] == "SliceFailed"


def test_a_completed_destroy_releases_the_slice_and_a_failed_one_keeps_it_with_its_error(api, node, acme):
    done = make_slice(node, acme, state="releasing", device_id="MIG-d1", handles={"gi": 1, "ci": 0})
    stuck = make_slice(node, acme, gpu_index=1, state="orphaned", device_id="MIG-d2", handles={"gi": 1, "ci": 0})
    first = make_slice_request(done, "destroy", status="processing")
    second = make_slice_request(stuck, "destroy", status="processing")
    ok = report_body(result={"destroyed": [{"uuid": "MIG-d1", "gi": 1, "ci": 0}]})
    assert api.put(url(first), ok, format="json", **AGENT).status_code == 200
    bad = report_body("failed", result={"destroyed": [], "handles": {"gi": 1}}, error="In use by another client")
    assert api.put(url(second), bad, format="json", **AGENT).status_code == 200
    done.refresh_from_db()
    stuck.refresh_from_db()
    assert done.state == "released" and done.released_at is not None
    assert stuck.state == "orphaned" and stuck.error == "In use by another client"
    assert stuck.handles == {"gi": 1}  # what the agent says is left (its compute instance went)


def test_a_report_after_the_time_out_is_409_saying_the_status(api, node, acme):
    slice_ = make_bound_slice(node, acme, state="issued")
    request = only_request(slice_)
    services.compensate(now=utcnow() + timedelta(seconds=121))
    answer = api.put(url(request), report_body(result={"device_id": "MIG-late"}), format="json", **AGENT)
    assert answer.status_code == 409
    assert "timed_out" in answer.json()["error"]["message"]
    slice_.refresh_from_db()
    assert slice_.state == "failed" and slice_.device_id == ""


# --- bodies refused ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, fields",
    [
        (report_body(bogus=1), {"bogus"}),
        (report_body(result={"created": [{"uuid": "MIG-x", "gi": "one"}]}), {"result"}),
        (report_body(result={"made": []}), {"result"}),
        ({"from_status": "processing", "status": "completed"}, {"node_id"}),
        (report_body(status="timed_out"), {"status"}),
        ({"node_id": "n1", "from_status": "pending", "status": "completed"}, {"status"}),
        ({**claim_body(), "result": {}}, {"result"}),
    ],
)
def test_a_bad_body_is_400_naming_its_fields_and_writes_nothing(api, node, acme, body, fields):
    slice_ = make_bound_slice(node, acme, state="issued")
    request = only_request(slice_)
    answer = api.put(url(request), body, format="json", **AGENT)
    assert answer.status_code == 400, answer.content
    assert set(answer.json()["error"]["fields"]) == fields
    request.refresh_from_db()
    slice_.refresh_from_db()
    assert (request.status, slice_.state) == ("processing", "issued")


def test_only_the_agent_key_reports(api, node, acme, world):
    request = only_request(make_bound_slice(node, acme, state="issued"))
    for key in (world.operator_key, world.keys["acme-admin"]):
        assert api.put(url(request), report_body(), format="json", **bearer(key)).status_code == 403
    assert SliceRequest.objects.get(pk=request.pk).status == "processing"
