"""POST /api/v1/tasks/batch: an array of N tasks in one request, all or none against the
quota, each with its index in its environment; and the scheduler asked once per interval."""

from unittest import mock

import pytest
from django.core.cache import cache
from django.test import override_settings

from apps.tasks import services
from apps.tasks.models import Task
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db
JOB = {"name": "sweep", "image": "registry.local/sweep:1", "command": ["python", "run.py"], "gpu_required": 1}


def batch(api, headers, count=3, **changes):
    return api.post("/api/v1/tasks/batch", JOB | {"array": {"count": count}} | changes, format="json", **headers)


def test_an_array_creates_count_tasks_and_lists_their_ids(api, world):
    response = batch(api, bearer(world.keys["acme-member"]), count=5, env={"LR": "0.1"})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["count"] == 5 and len(body["ids"]) == 5
    tasks = list(Task.objects.filter(pk__in=body["ids"]).order_by("array_index"))
    assert [t.pk for t in tasks] == body["ids"]
    assert [(t.array_index, t.array_size, t.tenant.slug, t.created_by.username, t.status) for t in tasks] == [
        (i, 5, "acme", "acme-member", "pending") for i in range(5)
    ]
    detail = api.get(f"/api/v1/tasks/{body['ids'][2]}", **bearer(world.keys["acme-viewer"])).json()
    assert (detail["array_index"], detail["array_size"], detail["env"]) == (2, 5, {"LR": "0.1"})


def test_each_member_gets_its_index_in_its_environment_and_its_own_env_cannot_override_it(api, world):
    body = batch(
        api,
        bearer(world.keys["acme-member"]),
        count=2,
        env={"HETEROFLOW_ARRAY_INDEX": "99", "HETEROFLOW_ARRAY_SIZE": "99", "LR": "0.1"},
    ).json()
    envs = [services.resolve_env(task)[0] for task in Task.objects.filter(pk__in=body["ids"]).order_by("array_index")]
    assert envs == [{"LR": "0.1", "HETEROFLOW_ARRAY_INDEX": str(i), "HETEROFLOW_ARRAY_SIZE": "2"} for i in range(2)]
    single = services.create_task(
        tenant=world.tenants["acme"], name="one", image="x", env={"HETEROFLOW_ARRAY_INDEX": "7"}
    )
    assert services.resolve_env(single) == ({}, [])  # not a member: the variables are not set at all


@pytest.mark.parametrize(
    "who,changes,expected",
    [
        ("acme-viewer", {}, 403),
        ("agent", {}, 403),
        ("operator", {}, 400),
        ("operator", {"tenant": "beta"}, 201),
        ("acme-admin", {"tenant": "beta"}, 404),
        ("acme-member", {"colour": "red"}, 400),
        ("acme-member", {"array": {"count": 2, "step": 1}}, 400),
        ("acme-member", {"array": {"count": 0}}, 400),
        ("acme-member", {"array": {"count": 6}}, 400),  # the setting below is 5
        ("acme-member", {"array": None}, 400),
        ("acme-member", {"env": {"TOKEN": {"secret": "nope"}}}, 400),
        ("acme-member", {"kind": "training", "preemptible": True}, 400),
    ],
)
@override_settings(HETEROFLOW_TASK_BATCH_MAX=5)
def test_batch_rules(api, world, who, changes, expected):
    headers = AGENT if who == "agent" else bearer(world.operator_key if who == "operator" else world.keys[who])
    before = Task.objects.count()
    response = batch(api, headers, **changes)
    assert response.status_code == expected, response.content
    assert Task.objects.count() == before + (3 if expected == 201 else 0)


def test_a_body_without_an_array_is_refused(api, world):
    response = api.post("/api/v1/tasks/batch", JOB, format="json", **bearer(world.keys["acme-member"]))
    assert response.status_code == 400
    assert "array" in response.json()["error"]["fields"]


def test_an_array_that_does_not_fit_the_quota_is_refused_whole(api, world):
    tenant = world.tenants["acme"]
    tenant.max_gpus = 10
    tenant.save()
    assert batch(api, bearer(world.keys["acme-member"]), count=4, gpu_required=2).status_code == 201
    response = batch(api, bearer(world.keys["acme-member"]), count=2, gpu_required=2)
    assert response.status_code == 409
    assert "8 of 10 GPUs in use, 4 more asked" in response.json()["error"]["message"]
    assert Task.objects.filter(tenant=tenant).count() == 4
    assert batch(api, bearer(world.keys["acme-member"]), count=1, gpu_required=2).status_code == 201


def test_creates_ask_for_one_cycle_per_interval_and_one_at_its_end(world, django_capture_on_commit_callbacks):
    services.forget_cycle_asks()
    tenant = world.tenants["acme"]
    with override_settings(HETEROFLOW_SUBMIT_TICK_SECONDS=2), mock.patch.object(services, "enqueue") as enqueue:
        for i in range(5):
            with django_capture_on_commit_callbacks(execute=True):
                services.create_task(tenant=tenant, name=f"t{i}", image="x")
    assert enqueue.call_args_list == [
        mock.call("scheduler.tick", immediate=True),
        mock.call("scheduler.tick", immediate=True, countdown=2),
    ]
    services.forget_cycle_asks()
    with override_settings(HETEROFLOW_SUBMIT_TICK_SECONDS=0), mock.patch.object(services, "enqueue") as enqueue:
        for i in range(3):
            with django_capture_on_commit_callbacks(execute=True):
                services.create_task(tenant=tenant, name=f"u{i}", image="x")
    assert enqueue.call_count == 3


def test_an_interval_another_process_opened_is_asked_of_redis_every_time(world, django_capture_on_commit_callbacks):
    """Only the process that sent the interval's end cycle may skip Redis: another's
    interval may end any moment, and a create after it must open the next."""
    services.forget_cycle_asks()
    tenant = world.tenants["acme"]
    with override_settings(HETEROFLOW_SUBMIT_TICK_SECONDS=2), mock.patch.object(services, "enqueue") as enqueue:
        cache.add(services.CYCLE_ASKED_KEY, 1, timeout=2)  # as another web process would
        with django_capture_on_commit_callbacks(execute=True):
            services.create_task(tenant=tenant, name="covered", image="x")
        assert enqueue.call_count == 0
        cache.delete(services.CYCLE_ASKED_KEY)  # that interval is over
        with django_capture_on_commit_callbacks(execute=True):
            services.create_task(tenant=tenant, name="next", image="x")
        assert enqueue.call_count == 2
    services.forget_cycle_asks()
