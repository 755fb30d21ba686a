"""No limit, no start, on the server: the agent's list of scheduled tasks leaves out a
memory-only task whose slice is not confirmed, and its claim is 409 until it is; the
task's detail and the agent's payload carry the slice."""

import pytest

from apps.scheduler.services import run_cycle
from apps.slices.models import Slice
from apps.tasks.models import Task
from tests.factories import make_node, make_task
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db

MIG = {"0": {"mig_capable": True, "mps_capable": False, "best_tier": 1}}
SLICE_KEYS = {
    "id",
    "tier",
    "qos",
    "state",
    "gpu_index",
    "gpu_uuid",
    "memory_mb",
    "memory_total_mb",
    "compute_percent",
    "profile",
    "device_id",
    "reason",
}
CLAIM = {"node_id": "n1", "from_status": "scheduled", "status": "running"}


def scheduled_list(api):
    response = api.get("/api/v1/tasks?node_id=n1&status=scheduled", **AGENT)
    assert response.status_code == 200
    return {task["id"]: task for task in response.json()["results"]}


def bound_share(world, memory=20000, **node_fields):
    make_node("n1", 1, model="NVIDIA H200", memory_total_mb=143771, **node_fields)
    task = make_task(world.tenants["acme"], gpu_required=0, gpu_memory_mb=memory)
    assert run_cycle().bound == [task.pk]
    return task


def test_a_memory_only_task_is_handed_out_and_claimed_only_once_its_slice_is_confirmed(api, world):
    task = bound_share(world, gpu_capabilities=MIG)
    whole = make_task(world.tenants["acme"], gpu_required=1, name="whole", status="scheduled", node_id="n1")
    listed = scheduled_list(api)
    assert set(listed) == {whole.pk}  # the share waits for its MIG instance
    assert listed[whole.pk]["slice"] is None
    refused = api.put(f"/api/v1/tasks/{task.pk}", CLAIM, format="json", **AGENT)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "slice_not_confirmed"
    assert Task.objects.get(pk=task.pk).status == "scheduled"
    # the agent's own read of the task shows why it waits
    payload = api.get(f"/api/v1/tasks/{task.pk}?node_id=n1", **AGENT).json()
    assert payload["slice"]["state"] == "requested" and payload["slice"]["profile"] == "1g.35gb"
    # the agent made it (apps.slices.services applies the report)
    Slice.objects.filter(task=task).update(state="confirmed", device_id="MIG-5f2c", handles={"gi": 3, "ci": 0})
    listed = scheduled_list(api)
    assert set(listed) == {task.pk, whole.pk}
    slice_ = listed[task.pk]["slice"]
    assert set(slice_) == SLICE_KEYS
    assert (slice_["tier"], slice_["qos"], slice_["state"], slice_["device_id"]) == (
        "mig",
        "gold",
        "confirmed",
        "MIG-5f2c",
    )
    assert (slice_["memory_mb"], slice_["memory_total_mb"], slice_["compute_percent"]) == (35840, 143771, 14)
    assert api.put(f"/api/v1/tasks/{task.pk}", CLAIM, format="json", **AGENT).status_code == 200


def test_a_software_slice_is_confirmed_at_bind_so_the_task_is_handed_out_at_once(api, world):
    task = bound_share(world, is_container=True)
    slice_ = scheduled_list(api)[task.pk]["slice"]
    assert (slice_["tier"], slice_["state"], slice_["memory_mb"], slice_["memory_total_mb"]) == (
        "software",
        "confirmed",
        20000,
        143771,
    )
    assert api.put(f"/api/v1/tasks/{task.pk}", CLAIM, format="json", **AGENT).status_code == 200


def test_a_memory_only_task_without_any_slice_never_starts(api, world):
    make_node("n1", 1)
    task = make_task(world.tenants["acme"], gpu_required=0, gpu_memory_mb=1000, status="scheduled", node_id="n1")
    assert task.pk not in scheduled_list(api)
    starting = CLAIM | {"status": "starting"}
    assert api.put(f"/api/v1/tasks/{task.pk}", starting, format="json", **AGENT).status_code == 409
    assert api.put(f"/api/v1/tasks/{task.pk}", CLAIM, format="json", **AGENT).status_code == 409
    # failing it is still the agent's to report
    failed = CLAIM | {"status": "failed", "error_message": "gave up"}
    assert api.put(f"/api/v1/tasks/{task.pk}", failed, format="json", **AGENT).status_code == 200


def test_a_released_slice_does_not_let_the_task_start(api, world):
    task = bound_share(world, is_container=True)
    Slice.objects.filter(task=task).update(state="released")
    assert task.pk not in scheduled_list(api)
    assert api.put(f"/api/v1/tasks/{task.pk}", CLAIM, format="json", **AGENT).status_code == 409


def test_the_task_detail_shows_the_tier_it_got_and_why(api, world):
    task = bound_share(world, gpu_capabilities=MIG)
    detail = api.get(f"/api/v1/tasks/{task.pk}", **bearer(world.keys["acme-viewer"])).json()
    slice_ = detail["slice"]
    assert (slice_["tier"], slice_["qos"], slice_["profile"]) == ("mig", "gold", "1g.35gb")
    assert "MIG mode enabled" in slice_["reason"]["why"]
    whole = make_task(world.tenants["acme"], gpu_required=1, name="whole")
    assert api.get(f"/api/v1/tasks/{whole.pk}", **bearer(world.keys["acme-viewer"])).json()["slice"] is None
    # another tenant sees neither the task nor its slice
    assert api.get(f"/api/v1/tasks/{task.pk}", **bearer(world.keys["beta-viewer"])).status_code == 404
