import pytest
from django.conf import settings

from apps.confidential.services import put_secret
from apps.nodes.models import Node
from apps.tasks.models import Task
from tests.factories import make_task
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db
JOB = {"name": "train-resnet", "image": "registry.local/resnet:1", "command": ["python", "train.py"], "gpu_required": 2}


def create(api, who_headers, **changes):
    return api.post("/api/v1/tasks", JOB | changes, format="json", **who_headers)


def test_a_member_queues_a_task_for_their_tenant(api, world):
    response = create(api, bearer(world.keys["acme-member"]))
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["status"], body["tenant"], body["priority"], body["created_by"]) == (
        "pending",
        "acme",
        50,
        "acme-member",
    )
    assert body["timeout_seconds"] == settings.HETEROFLOW_TASK_TIMEOUT_SECONDS


@pytest.mark.parametrize(
    "who,changes,expected",
    [
        ("acme-viewer", {}, 403),
        ("agent", {}, 403),
        ("operator", {}, 400),  # operators must name the tenant
        ("operator", {"tenant": "beta"}, 201),
        ("acme-admin", {"tenant": "beta"}, 404),
        ("acme-member", {"colour": "red"}, 400),
        ("acme-member", {"kind": "training", "preemptible": True}, 400),
        ("acme-member", {"priority": 101}, 400),
        ("acme-member", {"gpu_required": -1}, 400),
        ("acme-member", {"env": {"1BAD": "x"}}, 400),
        ("acme-member", {"env": {"TOKEN": {"secret": "nope"}}}, 400),
        ("acme-member", {"health_probe": {"type": "http", "port": 8000}}, 400),
        ("acme-member", {"kind": "inference", "health_probe": {"type": "http", "port": 8000}, "ports": [8000]}, 201),
    ],
)
def test_create_rules(api, world, who, changes, expected):
    headers = AGENT if who == "agent" else bearer(world.operator_key if who == "operator" else world.keys[who])
    before = Task.objects.count()
    response = create(api, headers, **changes)
    assert response.status_code == expected, response.content
    assert Task.objects.count() == before + (1 if expected == 201 else 0)


def test_unknown_top_level_fields_are_named(api, world):
    response = create(api, bearer(world.keys["acme-member"]), colour="red", size=2)
    assert response.json()["error"]["fields"] == {"colour": ["Unknown field."], "size": ["Unknown field."]}


def test_quota_refuses_what_does_not_fit_and_names_it(api, world):
    tenant = world.tenants["acme"]
    tenant.max_gpus, tenant.max_concurrent_tasks = 3, 10
    tenant.save()
    assert create(api, bearer(world.keys["acme-member"])).status_code == 201
    response = create(api, bearer(world.keys["acme-member"]))
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "quota_exceeded" and "2 of 3 GPUs in use, 2 more asked" in error["message"]


def test_list_is_scoped_and_in_queue_order(api, world):
    low = create(api, bearer(world.keys["acme-member"]), priority=10).json()
    high = create(api, bearer(world.keys["acme-member"]), priority=90).json()
    create(api, bearer(world.operator_key), tenant="beta")
    listed = [t["id"] for t in api.get("/api/v1/tasks", **bearer(world.keys["acme-viewer"])).json()["results"]]
    assert listed == [high["id"], low["id"]]
    other = Task.objects.filter(tenant__slug="beta").first()
    assert api.get(f"/api/v1/tasks/{other.pk}", **bearer(world.keys["acme-admin"])).status_code == 404


def test_stop_cancels_a_queued_task_and_viewers_cannot(api, world):
    task = create(api, bearer(world.keys["acme-member"])).json()
    assert api.post(f"/api/v1/tasks/{task['id']}/stop", **bearer(world.keys["acme-viewer"])).status_code == 403
    stopped = api.post(f"/api/v1/tasks/{task['id']}/cancel", **bearer(world.keys["acme-member"])).json()
    assert stopped["status"] == "cancelled" and stopped["finished_at"]
    again = api.post(f"/api/v1/tasks/{task['id']}/cancel", **bearer(world.keys["acme-member"]))
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_stop_asks_a_running_task_to_stop(api, world):
    task = Task.objects.create(tenant=world.tenants["acme"], name="r", status="running")
    assert api.post(f"/api/v1/tasks/{task.pk}/stop", **bearer(world.keys["acme-member"])).json()["status"] == "stopping"


def test_stats(api, world):
    create(api, bearer(world.keys["acme-member"]))
    Task.objects.create(tenant=world.tenants["acme"], name="r", status="running", gpu_required=4)
    stats = api.get("/api/v1/tasks/stats", **bearer(world.keys["acme-viewer"])).json()
    assert stats["total"] == 2 and stats["by_status"]["pending"] == 1 and stats["gpus_held"] == 4


# --- the agent channel -------------------------------------------------------------------


@pytest.fixture
def node():
    return Node.objects.create(id="n1", name="n1")


def test_the_agent_must_name_node_and_status(api, world, node):
    assert api.get("/api/v1/tasks", **AGENT).status_code == 400
    response = api.get("/api/v1/tasks?node_id=n1", **AGENT)
    assert response.status_code == 400 and "status" in response.json()["error"]["fields"]


def test_the_agent_gets_its_scheduled_tasks_with_secrets_resolved(api, world, node):
    tenant = world.tenants["acme"]
    put_secret(tenant, "hf-token", "s3cr3t")
    task = Task.objects.create(
        tenant=tenant, name="t", status="scheduled", node=node, env={"A": "1", "TOKEN": {"secret": "hf-token"}}
    )
    Task.objects.create(tenant=tenant, name="other", status="scheduled")
    results = api.get("/api/v1/tasks?node_id=n1&status=scheduled", **AGENT).json()["results"]
    assert [t["id"] for t in results] == [task.pk]
    assert results[0]["env"] == {"A": "1", "TOKEN": "s3cr3t"}
    # the stored task keeps the reference, never the value
    assert Task.objects.get(pk=task.pk).env["TOKEN"] == {"secret": "hf-token"}
    # people see the reference
    assert api.get(f"/api/v1/tasks/{task.pk}", **bearer(world.keys["acme-admin"])).json()["env"]["TOKEN"] == {
        "secret": "hf-token"
    }


def test_agent_reports_are_cas_and_idempotent(api, world, node):
    task = Task.objects.create(tenant=world.tenants["acme"], name="t", status="scheduled", node=node)
    claim = {"node_id": "n1", "from_status": "scheduled", "status": "running"}
    assert api.put(f"/api/v1/tasks/{task.pk}", claim, format="json", **AGENT).json()["started_at"]
    assert api.put(f"/api/v1/tasks/{task.pk}", claim, format="json", **AGENT).status_code == 409
    done = {"node_id": "n1", "from_status": "running", "status": "completed", "exit_code": 0}
    assert api.put(f"/api/v1/tasks/{task.pk}", done, format="json", **AGENT).json()["status"] == "completed"
    retried = api.put(f"/api/v1/tasks/{task.pk}", done | {"exit_code": 3}, format="json", **AGENT)
    assert retried.status_code == 409 and retried.json()["error"]["code"] == "status_changed"
    assert Task.objects.get(pk=task.pk).exit_code == 0
    illegal = {"node_id": "n1", "from_status": "completed", "status": "running"}
    assert api.put(f"/api/v1/tasks/{task.pk}", illegal, format="json", **AGENT).status_code == 400
    assert api.put(f"/api/v1/tasks/{task.pk}", claim | {"node_id": "n2"}, format="json", **AGENT).status_code == 404
    assert (
        api.put(f"/api/v1/tasks/{task.pk}", claim, format="json", **bearer(world.keys["acme-admin"])).status_code == 403
    )


def test_a_preempted_task_confirmed_returns_to_the_queue_once(api, world, node):
    task = Task.objects.create(tenant=world.tenants["acme"], name="t", status="preempting", node=node, preemptible=True)
    confirm = {"node_id": "n1", "from_status": "preempting", "status": "pending"}
    back = api.put(f"/api/v1/tasks/{task.pk}", confirm, format="json", **AGENT).json()
    assert (back["status"], back["node"], back["preempt_count"], back["preemptible"]) == ("pending", None, 1, False)
    completed = {"node_id": "n1", "from_status": "preempting", "status": "completed"}
    task2 = Task.objects.create(tenant=world.tenants["acme"], name="t2", status="preempting", node=node)
    assert api.put(f"/api/v1/tasks/{task2.pk}", completed, format="json", **AGENT).status_code == 400


def test_the_agent_reads_one_of_its_tasks_and_a_task_elsewhere_is_404(api, world, node):
    task = Task.objects.create(tenant=world.tenants["acme"], name="t", status="running", node=node)
    assert api.get(f"/api/v1/tasks/{task.pk}?node_id=n1", **AGENT).json()["status"] == "running"
    assert api.get(f"/api/v1/tasks/{task.pk}?node_id=n2", **AGENT).status_code == 404  # not ours: stop it
    assert api.get(f"/api/v1/tasks/{task.pk}", **AGENT).status_code == 400  # which node is asking?


def test_the_final_report_keeps_the_log_tail_for_the_tasks_readers(api, world, node):
    task = Task.objects.create(tenant=world.tenants["acme"], name="t", status="running", node=node)
    tail = "step 99 loss 0.01\n" * 50 + "done\n"
    report = {"node_id": "n1", "from_status": "running", "status": "failed", "exit_code": 3, "log_tail": tail}
    assert api.put(f"/api/v1/tasks/{task.pk}", report, format="json", **AGENT).status_code == 200
    logs = api.get(f"/api/v1/tasks/{task.pk}/logs", **bearer(world.keys["acme-viewer"])).json()
    assert logs["log_tail"] == tail and logs["status"] == "failed" and logs["exit_code"] == 3
    assert logs["lines"] == [] and logs["next"] == 0  # no live lines were shipped
    assert api.get(f"/api/v1/tasks/{task.pk}/logs", **bearer(world.keys["beta-viewer"])).status_code == 404
    too_long = report | {"log_tail": "x" * (64 * 1024 + 1)}
    assert api.put(f"/api/v1/tasks/{task.pk}", too_long, format="json", **AGENT).status_code == 400


def test_registry_credentials_reference_a_secret_and_reach_only_the_agent(api, world, node):
    tenant = world.tenants["acme"]
    put_secret(tenant, "registry-pw", "hunter2")
    headers = bearer(world.keys["acme-admin"])
    auth = {"registry": "registry.example.com:5000", "username": "ci", "password": {"secret": "registry-pw"}}
    created = api.post(
        "/api/v1/tasks",
        {"name": "t", "image": "registry.example.com:5000/team/app:1", "registry_auth": auth},
        format="json",
        **headers,
    )
    assert created.status_code == 201 and created.json()["registry_auth"] == auth  # people see the reference
    task = Task.objects.get(pk=created.json()["id"])
    assert "hunter2" not in str(task.registry_auth)  # nothing secret in public
    Task.objects.filter(pk=task.pk).update(status="scheduled", node=node)
    fetched = api.get("/api/v1/tasks?node_id=n1&status=scheduled", **AGENT).json()["results"][0]
    assert fetched["registry_auth"] == {
        "registry": "registry.example.com:5000",
        "username": "ci",
        "password": "hunter2",
    }


@pytest.mark.parametrize(
    "auth,field",
    [
        ({"registry": "r.example.com", "username": "ci", "password": "plain-text"}, "password"),
        ({"registry": "r.example.com", "username": "ci", "password": {"secret": "nope"}}, "registry_auth"),
        ({"registry": "r.example.com", "password": {"secret": "registry-pw"}}, "username"),
    ],
)
def test_bad_registry_credentials_are_refused_and_nothing_is_queued(api, world, auth, field):
    before = Task.objects.count()
    response = api.post(
        "/api/v1/tasks",
        {"name": "t", "image": "x", "registry_auth": auth},
        format="json",
        **bearer(world.keys["acme-admin"]),
    )
    assert response.status_code == 400 and field in str(response.json()["error"]["fields"])
    assert Task.objects.count() == before


def test_the_agent_adds_to_a_tasks_history_and_its_readers_see_it(api, world, node):
    task = Task.objects.create(tenant=world.tenants["acme"], name="t", status="running", node=node, kind="training")
    event = {
        "node_id": "n1",
        "kind": "checkpoint_resume",
        "message": "resuming from /ckpt/epoch-2 (marker)",
        "details": {"resume_from": "/ckpt/epoch-2"},
    }
    assert api.post(f"/api/v1/tasks/{task.pk}/events", event, format="json", **AGENT).status_code == 201
    assert (
        api.post(f"/api/v1/tasks/{task.pk}/events", event | {"node_id": "n2"}, format="json", **AGENT).status_code
        == 404
    )
    assert (
        api.post(f"/api/v1/tasks/{task.pk}/events", event | {"kind": "Bad Kind"}, format="json", **AGENT).status_code
        == 400
    )
    assert (
        api.post(
            f"/api/v1/tasks/{task.pk}/events", event, format="json", **bearer(world.keys["acme-admin"])
        ).status_code
        == 403
    )
    history = api.get(f"/api/v1/tasks/{task.pk}/events", **bearer(world.keys["acme-viewer"])).json()
    assert [(e["kind"], e["node"], e["details"]) for e in history] == [
        ("checkpoint_resume", "n1", {"resume_from": "/ckpt/epoch-2"})
    ]
    assert api.get(f"/api/v1/tasks/{task.pk}/events", **bearer(world.keys["beta-viewer"])).status_code == 404


def ignored_on(channel, field):
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("heteroflow_agent_fields_ignored_total", {"channel": channel, "field": field}) or 0


def test_a_newer_agents_unknown_report_fields_are_ignored_and_counted(api, world, node, caplog):
    """Version skew on the task channel: a report, an event and a lost-container report
    from an agent that sends a field this server does not know are applied as if the
    field were absent (counted, logged once); the known fields stay strict; people's
    bodies stay strict."""
    task = Task.objects.create(tenant=world.tenants["acme"], name="t", status="scheduled", node=node)
    before = ignored_on("report", "gpu_seconds")
    claim = {"node_id": "n1", "from_status": "scheduled", "status": "running", "gpu_seconds": 1.5}
    with caplog.at_level("WARNING", logger="apps.core.serializers"):
        assert api.put(f"/api/v1/tasks/{task.pk}", claim, format="json", **AGENT).json()["status"] == "running"
        bad = claim | {"from_status": "running", "status": "completed", "exit_code": "zero"}
        answer = api.put(f"/api/v1/tasks/{task.pk}", bad, format="json", **AGENT)
        assert answer.status_code == 400 and sorted(answer.json()["error"]["fields"]) == ["exit_code"]
        done = claim | {"from_status": "running", "status": "completed", "exit_code": 0}
        assert api.put(f"/api/v1/tasks/{task.pk}", done, format="json", **AGENT).json()["status"] == "completed"
    assert ignored_on("report", "gpu_seconds") == before + 2
    assert len([r for r in caplog.records if "gpu_seconds" in r.getMessage()]) <= 1
    running = Task.objects.create(tenant=world.tenants["acme"], name="t2", status="running", node=node)
    event = {"node_id": "n1", "kind": "checkpoint_resume", "message": "m", "trace_id": "abc"}
    assert api.post(f"/api/v1/tasks/{running.pk}/events", event, format="json", **AGENT).status_code == 201
    assert running.events.get().details == {}
    person = create(api, bearer(world.keys["acme-member"]), gpu_seconds=1)
    assert person.status_code == 400 and person.json()["error"]["fields"] == {"gpu_seconds": ["Unknown field."]}


def test_the_list_gives_the_newest_first_and_only_active_ones_when_asked(api, world):
    tenant = world.tenants["acme"]
    old = make_task(tenant, name="old", priority=90)
    done = make_task(tenant, name="done", status="completed")
    new = make_task(tenant, name="new", priority=10)
    key = bearer(world.keys["acme-viewer"])
    queue = [row["id"] for row in api.get("/api/v1/tasks", **key).json()["results"]]
    assert queue.index(old.pk) < queue.index(new.pk)  # queue order: priority first
    newest = [row["id"] for row in api.get("/api/v1/tasks?ordering=newest", **key).json()["results"]]
    assert newest[:3] == [new.pk, done.pk, old.pk]
    active = [row["id"] for row in api.get("/api/v1/tasks?ordering=newest&active=true", **key).json()["results"]]
    assert done.pk not in active and active[:2] == [new.pk, old.pk]
    assert api.get("/api/v1/tasks?ordering=oldest", **key).status_code == 400
