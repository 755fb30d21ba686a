"""The task-group API: a group is submitted whole (its row and its world_size members in
one transaction, the quota checked for all of them at once under the tenant's lock) or
not at all; read, listed, stopped and its history read within the caller's tenant."""

from itertools import combinations_with_replacement

import pytest
from django.conf import settings
from django.test import override_settings

from apps.alerts.models import Alert
from apps.confidential.services import put_secret
from apps.core.errors import Conflict
from apps.scheduler.services import run_cycle
from apps.tasks import services
from apps.tasks.choices import TaskStatus, group_status
from apps.tasks.models import Task, TaskGroup
from apps.tasks.selectors import with_group_status
from apps.tenants.models import Tenant
from tests.factories import make_group, make_node
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db

GROUP = {
    "name": "llm-pretrain",
    "strategy": "fsdp",
    "world_size": 4,
    "gpus_per_worker": 2,
    "gpu_type": "nvidia",
    "image": "registry.local/trainer:2",
    "command": ["torchrun", "train.py"],
    "env": {"EPOCHS": "3"},
    "volumes": [{"host": "/data/ckpt", "container": "/ckpt"}],
    "checkpoint_path": "/ckpt/llm",
    "priority": 70,
    "labels": {"zone": "az1"},
}


def submit(api, headers, **changes):
    return api.post("/api/v1/task-groups", GROUP | changes, format="json", **headers)


def written() -> tuple[int, int]:
    return TaskGroup.objects.count(), Task.objects.count()


def with_quota(tenant, **limits) -> Tenant:
    """The tenant's quota set for this test (the test's savepoint undoes it), on a copy of
    its row: the module's shared `world` keeps its own."""
    tenant = Tenant.objects.get(pk=tenant.pk)
    for name, value in limits.items():
        setattr(tenant, name, value)
    tenant.save()
    return tenant


def members(group_id: int) -> list[Task]:
    return list(Task.objects.filter(group_id=group_id).order_by("rank"))


# --- create -------------------------------------------------------------------------------------


def test_a_member_submits_a_group_and_gets_its_ranked_members(api, world):
    acme = world.tenants["acme"]
    response = submit(api, bearer(world.keys["acme-member"]))
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["tenant"], body["status"], body["kind"], body["strategy"], body["created_by"]) == (
        "acme",
        "pending",
        "training",
        "fsdp",
        "acme-member",
    )
    assert (body["world_size"], body["gpus_per_worker"], body["attempts"], body["network"]) == (4, 2, 0, {})
    assert [(m["rank"], m["name"], m["status"], m["node"]) for m in body["members"]] == [
        (rank, f"llm-pretrain-{rank}", "pending", None) for rank in range(4)
    ]
    group = TaskGroup.objects.get(pk=body["id"])
    assert (group.tenant, group.created_by, group.checkpoint_path) == (acme, world.users["acme-member"], "/ckpt/llm")
    for rank, task in enumerate(members(group.pk)):
        assert task.pk == body["members"][rank]["id"] and task.rank == rank
        assert (task.kind, task.gpu_required, task.gpu_type, task.priority, task.preemptible) == (
            "training",
            2,
            "nvidia",
            70,
            False,
        )
        assert (task.image, task.command, task.env, task.labels) == (
            GROUP["image"],
            GROUP["command"],
            GROUP["env"],
            GROUP["labels"],
        )
        assert (task.volumes, task.checkpoint_path) == ([{**GROUP["volumes"][0], "read_only": False}], "/ckpt/llm")
        assert (task.tenant, task.created_by, task.timeout_seconds) == (
            acme,
            world.users["acme-member"],
            settings.HETEROFLOW_TASK_TIMEOUT_SECONDS,
        )
    assert services.quota_use(acme) == {"tasks": 4, "gpus": 8, "gpu_memory_mb": 0}


def test_defaults_and_an_operator_naming_the_tenant(api, world):
    body = {"name": "small", "world_size": 1, "gpu_type": "ascend", "image": "x", "tenant": "beta"}
    response = api.post("/api/v1/task-groups", body, format="json", **bearer(world.operator_key))
    assert response.status_code == 201, response.content
    group = response.json()
    assert (group["tenant"], group["strategy"], group["gpus_per_worker"], group["priority"]) == ("beta", "ddp", 1, 50)
    (member,) = members(group["id"])
    assert (member.gpu_required, member.gpu_type, member.timeout_seconds) == (1, "ascend", 7200)
    timed = submit(api, bearer(world.keys["acme-member"]), timeout_seconds=86_400, world_size=2).json()
    assert {t.timeout_seconds for t in members(timed["id"])} == {86_400}


def test_a_long_name_still_gives_each_member_a_name_that_fits(api, world):
    response = submit(api, bearer(world.keys["acme-member"]), name="n" * 200, world_size=12)
    assert response.status_code == 201, response.content
    names = [task.name for task in members(response.json()["id"])]
    assert all(len(name) <= 200 for name in names) and names[11].endswith("-11") and len(set(names)) == 12


def test_unknown_fields_are_named_and_nothing_is_written(api, world):
    before = written()
    response = submit(api, bearer(world.keys["acme-member"]), colour="red", gpus=3)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["fields"] == {"colour": ["Unknown field."], "gpus": ["Unknown field."]}
    assert error["message"] == "Unknown field(s): colour, gpus."
    assert written() == before


@pytest.mark.parametrize(
    "who,changes,status,field",
    [
        ("acme-member", {"world_size": 0}, 400, "world_size"),
        ("acme-member", {"world_size": 9}, 400, "world_size"),  # over HETEROFLOW_GROUP_MAX_WORLD_SIZE (8 here)
        ("acme-member", {"world_size": "four"}, 400, "world_size"),
        ("acme-member", {"gpus_per_worker": 0}, 400, "gpus_per_worker"),
        ("acme-member", {"gpus_per_worker": 65}, 400, "gpus_per_worker"),
        ("acme-member", {"strategy": "zero3"}, 400, "strategy"),
        ("acme-member", {"kind": "job"}, 400, "kind"),
        ("acme-member", {"gpu_type": "tpu"}, 400, "gpu_type"),
        ("acme-member", {"gpu_type": ""}, 400, "gpu_type"),
        ("acme-member", {"priority": 101}, 400, "priority"),
        ("acme-member", {"image": ""}, 400, "image"),
        ("acme-member", {"env": {"1BAD": "x"}}, 400, "env"),
        ("acme-member", {"env": {"TOKEN": {"secret": "nope"}}}, 400, "env"),
        ("acme-member", {"env": {"N": 3}}, 400, "env"),
        ("acme-member", {"volumes": [{"host": "/a"}]}, 400, "volumes"),
        ("acme-member", {"labels": {"zone": {"nested": "no"}}}, 400, "labels"),
        ("acme-viewer", {}, 403, None),
        ("agent", {}, 403, None),
        ("operator", {}, 400, "tenant"),  # operators must name the tenant
        ("acme-admin", {"tenant": "beta"}, 404, None),  # another tenant reads as absent
    ],
)
@override_settings(HETEROFLOW_GROUP_MAX_WORLD_SIZE=8)
def test_every_refusal_is_clear_and_writes_nothing(api, world, who, changes, status, field):
    headers = AGENT if who == "agent" else bearer(world.operator_key if who == "operator" else world.keys[who])
    before = written()
    response = submit(api, headers, **changes)
    assert response.status_code == status, response.content
    if field:
        assert list(response.json()["error"]["fields"]) == [field]
    assert written() == before


def test_a_vendor_or_strategy_not_known_is_refused_with_the_known_ones(api, world):
    fields = submit(api, bearer(world.keys["acme-member"]), gpu_type="tpu", strategy="zero3").json()["error"]["fields"]
    assert fields["gpu_type"] == [
        '"tpu" is not a known GPU vendor: one of nvidia, amd, musa, hygon, cambricon, biren, ascend, kunlun, '
        "iluvatar, metax, enflame, virtual."
    ]
    assert fields["strategy"] == ['"zero3" is not a strategy: one of ddp, deepspeed, fsdp, tp, pp.']


def test_missing_required_fields_are_each_named(api, world):
    response = api.post("/api/v1/task-groups", {}, format="json", **bearer(world.keys["acme-member"]))
    assert response.status_code == 400
    assert set(response.json()["error"]["fields"]) == {"name", "world_size", "gpu_type", "image"}


def test_an_inference_group_is_refused_for_now_in_words(api, world):
    before = written()
    response = submit(api, bearer(world.keys["acme-member"]), kind="inference")
    assert response.status_code == 400
    (message,) = response.json()["error"]["fields"]["kind"]
    assert "Only training groups" in message and "inference services" in message
    assert written() == before


def test_a_secret_the_tenant_has_is_accepted_and_stays_a_reference(api, world):
    put_secret(world.tenants["acme"], "hf-token", "s3cret")
    response = submit(api, bearer(world.keys["acme-member"]), env={"HF_TOKEN": {"secret": "hf-token"}})
    assert response.status_code == 201, response.content
    assert {str(t.env) for t in members(response.json()["id"])} == {str({"HF_TOKEN": {"secret": "hf-token"}})}


# --- the quota: the whole group, at once ----------------------------------------------------------


@pytest.mark.parametrize(
    "quota,message",
    [
        ({"max_gpus": 7}, "0 of 7 GPUs in use, 8 more asked"),
        ({"max_concurrent_tasks": 3}, "0 of 3 concurrent tasks in use, 4 more asked"),
    ],
)
def test_a_group_over_the_quota_is_refused_whole(api, world, quota, message):
    acme = with_quota(world.tenants["acme"], **quota)
    before = written()
    response = submit(api, bearer(world.keys["acme-member"]))
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "quota_exceeded" and message in error["message"]
    assert written() == before  # not the group row, not one member
    assert services.quota_use(acme) == {"tasks": 0, "gpus": 0, "gpu_memory_mb": 0}
    # the refusal is on record for the tenant (the alert is not rolled back with the group)
    assert Alert.objects.filter(type="QUOTA_EXCEEDED", tenant_id=acme.pk, state="ACTIVE").exists()


def test_a_group_that_exactly_fits_the_quota_is_accepted(api, world):
    with_quota(world.tenants["acme"], max_gpus=8)
    assert submit(api, bearer(world.keys["acme-member"])).status_code == 201
    assert submit(api, bearer(world.keys["acme-member"]), world_size=1, gpus_per_worker=1).status_code == 409


def test_the_service_refuses_fields_a_group_does_not_have(world):
    with pytest.raises(TypeError, match="gpu_required"):
        services.create_group(world.tenants["acme"], {"name": "g", "world_size": 1, "gpu_required": 2})


# --- reading -------------------------------------------------------------------------------------


def test_the_detail_shows_the_ranks_on_their_nodes_and_the_network_decision(api, world):
    for n in range(2):
        make_node(f"n{n}", gpus=4, zone="z1", rack="r1")
    created = submit(api, bearer(world.keys["acme-member"])).json()
    assert run_cycle().groups_bound == [created["id"]]
    body = api.get(f"/api/v1/task-groups/{created['id']}", **bearer(world.keys["acme-viewer"])).json()
    assert (body["status"], body["attempts"], body["schedule_reason"]) == ("scheduled", 1, {})
    assert [(m["rank"], m["node"], m["status"], len(m["gpu_indices"])) for m in body["members"]] == [
        (0, "n0", "scheduled", 2),
        (1, "n0", "scheduled", 2),
        (2, "n1", "scheduled", 2),
        (3, "n1", "scheduled", 2),
    ]
    master = body["members"][0]
    assert master["host_port"] is not None and master["host_port"] == body["network"]["master_port"]
    assert body["network"]["backend"] == "gloo" and body["network"]["reason"]  # nodes not proven on one network
    assert body["network"]["master_node"] == "n0"


def test_a_waiting_group_says_why(api, world):
    make_node("n0", gpus=2)
    created = submit(api, bearer(world.keys["acme-member"])).json()
    run_cycle()
    body = api.get(f"/api/v1/task-groups/{created['id']}", **bearer(world.keys["acme-member"])).json()
    assert body["status"] == "pending"
    assert body["schedule_reason"]["message"] == "not enough nodes of type nvidia in the tenant's reach: 1 of 4 workers"


def test_another_tenants_group_is_absent_everywhere(api, world):
    theirs = make_group(world.tenants["beta"], workers=2, gpus=1)
    acme = bearer(world.keys["acme-admin"])
    for method, path in [
        ("get", ""),
        ("post", "/stop"),
        ("get", "/events"),
    ]:
        response = getattr(api, method)(f"/api/v1/task-groups/{theirs.pk}{path}", **acme)
        assert response.status_code == 404, (path, response.content)
        assert response.json()["error"]["code"] == "not_found"
    assert api.get("/api/v1/task-groups/999999", **acme).status_code == 404
    assert {t.status for t in members(theirs.pk)} == {"pending"}  # the refused stop changed nothing
    assert api.get(f"/api/v1/task-groups/{theirs.pk}", **bearer(world.operator_key)).status_code == 200


def test_the_list_is_scoped_newest_first_and_paged(api, world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    ours = [make_group(acme, workers=2, gpus=1, name=f"a{i}").pk for i in range(3)]
    theirs = make_group(beta, workers=1, gpus=1, name="b").pk
    viewer = bearer(world.keys["acme-viewer"])
    listed = api.get("/api/v1/task-groups", **viewer).json()
    assert listed["count"] == 3 and [g["id"] for g in listed["results"]] == ours[::-1]
    assert all(g["status"] == "pending" and "members" not in g for g in listed["results"])
    first = api.get("/api/v1/task-groups?limit=2", **viewer).json()
    assert (first["count"], [g["id"] for g in first["results"]]) == (3, ours[:0:-1]) and first["next"]
    second = api.get("/api/v1/task-groups?limit=2&offset=2", **viewer).json()
    assert [g["id"] for g in second["results"]] == [ours[0]] and second["next"] is None
    everything = api.get("/api/v1/task-groups?limit=500", **bearer(world.operator_key)).json()
    assert {g["id"] for g in everything["results"]} >= {*ours, theirs}
    assert api.get("/api/v1/task-groups?limit=501", **viewer).status_code == 400
    assert api.get("/api/v1/task-groups?colour=red", **viewer).status_code == 400
    assert api.get("/api/v1/task-groups?status=sleeping", **viewer).status_code == 400
    assert api.get("/api/v1/task-groups", **AGENT).status_code == 403


def test_the_list_filters_on_the_derived_status(api, world):
    acme = world.tenants["acme"]
    waiting = make_group(acme, workers=2, gpus=1, name="waiting")
    ended = make_group(acme, workers=2, gpus=1, name="ended")
    half = make_group(acme, workers=2, gpus=1, name="half")
    services.stop_group(ended)
    Task.objects.filter(group=half, rank=0).update(status=TaskStatus.RUNNING)
    Task.objects.filter(group=half, rank=1).update(status=TaskStatus.FAILED)
    member = bearer(world.keys["acme-member"])

    def ids(status):
        return [g["id"] for g in api.get(f"/api/v1/task-groups?status={status}", **member).json()["results"]]

    assert (ids("pending"), ids("stopped"), ids("stopping"), ids("running")) == (
        [waiting.pk],
        [ended.pk],
        [half.pk],
        [],
    )


@pytest.mark.parametrize("placement", ["gang", "replicas"])
def test_the_sql_status_agrees_with_the_rule_for_every_mix_of_members(world, placement):
    """with_group_status (the list's filter) against choices.group_status (what a group
    shows), over every multiset of up to three member statuses, for both placements."""
    acme = world.tenants["acme"]
    mixes = [mix for size in range(4) for mix in combinations_with_replacement(TaskStatus.values, size)]
    groups = TaskGroup.objects.bulk_create(
        TaskGroup(
            tenant=acme, name=f"m{i}", world_size=max(len(mix), 1), gpu_type="nvidia", image="x", placement=placement
        )
        for i, mix in enumerate(mixes)
    )
    Task.objects.bulk_create(
        Task(tenant=acme, name="w", image="x", kind="training", group=group, rank=rank, status=status)
        for group, mix in zip(groups, mixes, strict=True)
        for rank, status in enumerate(mix)
    )
    derived = dict(
        with_group_status(TaskGroup.objects.filter(pk__in=[g.pk for g in groups])).values_list("pk", "derived_status")
    )
    disagree = [
        (mix, derived[group.pk], group_status(mix, placement))
        for group, mix in zip(groups, mixes, strict=True)
        if derived[group.pk] != group_status(mix, placement)
    ]
    assert len(derived) == len(mixes) > 500 and disagree == []


# --- stop ----------------------------------------------------------------------------------------


def test_stopping_a_waiting_group_cancels_every_member_and_twice_is_409(api, world):
    group = make_group(world.tenants["acme"], workers=3, gpus=1)
    member = bearer(world.keys["acme-member"])
    response = api.post(f"/api/v1/task-groups/{group.pk}/stop", **member)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "stopped" and {m["status"] for m in body["members"]} == {"cancelled"}
    again = api.post(f"/api/v1/task-groups/{group.pk}/stop", **member)
    assert again.status_code == 409 and again.json()["error"]["code"] == "invalid_state"
    assert "is stopped" in again.json()["error"]["message"]


def test_stopping_a_running_group_asks_every_worker_to_stop(api, world):
    for n in range(2):
        make_node(f"n{n}", gpus=4)
    created = submit(api, bearer(world.keys["acme-member"])).json()
    assert run_cycle().groups_bound == [created["id"]]
    workers = members(created["id"])
    for task in workers[:3]:  # rank 3 has not started yet
        assert services.agent_report(task, from_status="scheduled", to_status="running")
    member = bearer(world.keys["acme-member"])
    body = api.post(f"/api/v1/task-groups/{created['id']}/stop", **member).json()
    assert body["status"] == "stopping"
    assert [m["status"] for m in body["members"]] == ["stopping", "stopping", "stopping", "cancelled"]
    # asking again while it stops is not an error, and changes nothing
    again = api.post(f"/api/v1/task-groups/{created['id']}/stop", **member)
    assert again.status_code == 200 and again.json()["status"] == "stopping"
    for task in workers[:3]:
        task.refresh_from_db()
        assert services.agent_report(task, from_status="stopping", to_status="stopped")
    assert api.get(f"/api/v1/task-groups/{created['id']}", **member).json()["status"] == "stopped"
    assert api.post(f"/api/v1/task-groups/{created['id']}/stop", **member).status_code == 409
    assert services.quota_use(world.tenants["acme"])["tasks"] == 0


def test_a_completed_group_cannot_be_stopped_and_viewers_cannot_stop(api, world):
    group = make_group(world.tenants["acme"], workers=2, gpus=1)
    assert api.post(f"/api/v1/task-groups/{group.pk}/stop", **bearer(world.keys["acme-viewer"])).status_code == 403
    assert {t.status for t in members(group.pk)} == {"pending"}
    Task.objects.filter(group=group).update(status=TaskStatus.COMPLETED)
    response = api.post(f"/api/v1/task-groups/{group.pk}/stop", **bearer(world.keys["acme-member"]))
    assert response.status_code == 409 and "is completed" in response.json()["error"]["message"]
    with pytest.raises(Conflict):
        services.stop_group(group)


# --- events --------------------------------------------------------------------------------------


def test_the_events_of_every_member_newest_first_with_their_rank(api, world):
    group = make_group(world.tenants["acme"], workers=2, gpus=1)
    rank0, rank1 = members(group.pk)
    services.record_event(rank0, kind="checkpoint_resume", message="resumed from step 100")
    services.record_event(rank1, kind="checkpoint_resume", message="resumed from step 100")
    services.record_event(rank0, kind="requeued", message="node lost")
    make_group(world.tenants["acme"], workers=1, gpus=1, name="other")
    services.record_event(members(TaskGroup.objects.get(name="other").pk)[0], kind="requeued", message="not ours")
    viewer = bearer(world.keys["acme-viewer"])
    body = api.get(f"/api/v1/task-groups/{group.pk}/events", **viewer).json()
    assert body["count"] == 3
    assert [(e["rank"], e["task"], e["kind"]) for e in body["results"]] == [
        (0, rank0.pk, "requeued"),
        (1, rank1.pk, "checkpoint_resume"),
        (0, rank0.pk, "checkpoint_resume"),
    ]
    page = api.get(f"/api/v1/task-groups/{group.pk}/events?limit=1&offset=1", **viewer).json()
    assert [e["rank"] for e in page["results"]] == [1] and page["next"] and page["previous"]
    assert api.get(f"/api/v1/task-groups/{group.pk}/events?limit=0", **viewer).status_code == 400


def test_the_schema_describes_the_group_endpoints(client):
    paths = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]
    assert {"post", "get"} <= set(paths["/api/v1/task-groups"])
    assert "get" in paths["/api/v1/task-groups/{id}"]
    assert "post" in paths["/api/v1/task-groups/{id}/stop"]
    for path in ("/api/v1/task-groups", "/api/v1/task-groups/{id}/events"):
        listed = paths[path]["get"]
        assert {"limit", "offset"} <= {parameter["name"] for parameter in listed["parameters"]}
        assert "Paginated" in listed["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
