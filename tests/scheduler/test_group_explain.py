"""Why a task group waits, through the API: the group dry run
(POST /api/v1/scheduler/dry-run/group) and a group's explanation
(GET /api/v1/task-groups/{id}/explain), in the issue's words, reservations included;
scoped like the task API (another tenant's group is 404)."""

import pytest

from apps.scheduler.models import GpuAllocation
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task
from tests.factories import make_group, make_node, make_task_holding
from tests.headers import bearer

pytestmark = pytest.mark.django_db

DRY_RUN = "/api/v1/scheduler/dry-run/group"


def dry_run(api, key, **body):
    return api.post(DRY_RUN, body, format="json", **bearer(key))


def explain(api, key, group):
    return api.get(f"/api/v1/task-groups/{group.pk}/explain", **bearer(key))


def test_the_group_dry_run_places_every_worker_or_says_why(api, world):
    key = world.keys["acme-viewer"]
    for n in range(3):
        make_node(f"n{n}", gpus=8, zone="z1", rack="r1")
    make_node("theirs", gpus=8, vendor="ascend", tenant=world.tenants["beta"])
    fits = dry_run(api, key, world_size=2, gpus_per_worker=8, gpu_type="nvidia", strategy="pp").json()
    assert fits["placed"] is True and fits["reason"] is None and fits["score"] == 6
    assert [w["rank"] for w in fits["workers"]] == [0, 1]
    assert len({w["node_id"] for w in fits["workers"]}) == 2
    assert all(len(w["gpu_indices"]) == 8 for w in fits["workers"])
    short = dry_run(api, key, world_size=4, gpus_per_worker=8, gpu_type="nvidia").json()
    assert short["placed"] is False and short["workers"] == []
    assert short["reason"]["message"] == "not enough nodes of type nvidia in the tenant's reach: 3 of 4 workers"
    assert short["reason"]["workers"] == {"placeable": 3, "needed": 4, "reach": 3}
    # another tenant's ascend node is not in acme's reach
    missing = dry_run(api, key, world_size=1, gpu_type="ascend").json()
    assert (missing["reason"]["code"], missing["reason"]["message"]) == ("GpuTypeNotPresent", "type ascend not present")
    assert dry_run(api, world.keys["beta-viewer"], world_size=1, gpus_per_worker=8, gpu_type="ascend").json()["placed"]
    # nothing was bound or created
    assert not GpuAllocation.objects.exists() and not Task.objects.exists()


@pytest.mark.parametrize(
    "body,field",
    [
        ({"gpu_type": "nvidia"}, "world_size"),
        ({"world_size": 2}, "gpu_type"),
        ({"world_size": 2, "gpu_type": "nvidia", "gpu_required": 1}, "gpu_required"),
        ({"world_size": 2, "gpu_type": "nvidia", "strategy": "mesh"}, "strategy"),
        ({"world_size": 0, "gpu_type": "nvidia"}, "world_size"),
    ],
)
def test_the_group_dry_run_body_is_strict(api, world, body, field):
    response = dry_run(api, world.keys["acme-viewer"], **body)
    assert response.status_code == 400 and field in str(response.json())


def test_an_operator_names_the_tenant(api, world):
    make_node("n0", gpus=8)
    assert dry_run(api, world.operator_key, world_size=1, gpu_type="nvidia").status_code == 400
    assert dry_run(api, world.operator_key, world_size=1, gpu_type="nvidia", tenant="acme").json()["placed"]


def test_explain_says_why_a_group_waits_and_where_it_would_go_now(api, world):
    acme = world.tenants["acme"]
    make_node("n0", gpus=8)
    make_node("n1", gpus=4)
    group = make_group(acme, workers=4, gpus=4)
    run_cycle()
    answer = explain(api, world.keys["acme-viewer"], group).json()
    assert answer["group_id"] == group.pk and answer["status"] == "pending"
    message = answer["schedule_reason"]["message"]
    assert message == "not enough nodes of type nvidia in the tenant's reach: 3 of 4 workers"
    assert answer["now"]["placed"] is False and answer["now"]["reason"]["workers"]["placeable"] == 3
    # the fleet grew since the last cycle: now it would go
    make_node("n2", gpus=4)
    answer = explain(api, world.keys["acme-viewer"], group).json()
    assert answer["now"]["placed"] is True and len(answer["now"]["workers"]) == 4
    assert answer["schedule_reason"]["workers"]["placeable"] == 3  # the last cycle's, until the next one
    run_cycle()
    answer = explain(api, world.keys["acme-viewer"], group).json()
    assert (answer["status"], answer["schedule_reason"], answer["now"]) == ("scheduled", {}, None)
    assert answer["network"]["master_port"] >= 8000


def test_another_tenants_group_is_not_found(api, world):
    group = make_group(world.tenants["beta"], workers=1)
    assert explain(api, world.keys["acme-admin"], group).status_code == 404
    assert explain(api, world.keys["beta-viewer"], group).status_code == 200
    assert explain(api, world.operator_key, group).status_code == 200


def test_a_reservation_is_explained_on_the_group_and_met_by_a_dry_run_behind_it(api, world, settings):
    settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS = 0
    acme = world.tenants["acme"]
    key = world.keys["acme-viewer"]
    n0, n1 = make_node("n0", gpus=4), make_node("n1", gpus=4)
    make_task_holding(n1, acme, "running", card=0)
    make_task_holding(n0, acme, "running", card=0)
    Task.objects.filter(node_id="n0").update(status="completed")
    GpuAllocation.objects.filter(node_id="n0").delete()  # n0 all free, n1 three of four
    group = make_group(acme, workers=2, gpus=4)
    run_cycle()
    answer = explain(api, key, group).json()
    reason = answer["schedule_reason"]
    assert (reason["code"], reason["message"]) == ("Reserved", "reserved, 1 of 2 nodes held")
    assert answer["reservation"]["state"] == "holding" and answer["reservation"]["nodes_held"] == 1
    assert reason["reservation"] == answer["reservation"]
    # the group's own dry run does not meet its own holds
    assert answer["now"]["reason"]["workers"]["placeable"] == 1
    # a request behind it (the same priority, or lower) meets them; a higher one does not
    behind = dry_run(api, key, world_size=1, gpus_per_worker=2, gpu_type="nvidia").json()
    assert behind["placed"] is False and behind["reason"]["removed_by"] == {"reserved": 2}
    single = api.post("/api/v1/scheduler/dry-run", {"gpu_required": 1}, format="json", **bearer(key)).json()
    assert single["placed"] is False and single["reason"]["removed_by"] == {"reserved": 2}
    ahead = dry_run(api, key, world_size=1, gpus_per_worker=2, gpu_type="nvidia", priority=90).json()
    assert ahead["placed"] is True
