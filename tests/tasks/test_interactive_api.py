"""Interactive tasks through the API (docs/interactive.md): an app (jupyter by default, or
shell) and no command; an idle time (the tenant's default, never past its ceiling) and
max_hours (its declared duration and timeout); a token of its own that the task object
never shows and the agent and GET /tasks/{id}/app do; a host port at bind. Bad input is
400 with nothing written."""

from __future__ import annotations

import pytest

from apps.nodes.models import Node
from apps.scheduler.services import run_cycle
from apps.tasks.models import Task
from apps.tenants.models import Tenant
from tests.factories import make_node
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db

NOTEBOOK = {"name": "nb", "kind": "interactive", "image": "quay.io/jupyter/base-notebook", "gpu_required": 1}


def create(api, world, body, who="acme-member"):
    return api.post("/api/v1/tasks", body, format="json", **bearer(world.keys[who]))


def test_a_notebook_gets_its_defaults_and_a_token_only_the_agent_and_app_endpoint_show(api, world, settings):
    answer = create(api, world, NOTEBOOK)
    assert answer.status_code == 201, answer.json()
    body = answer.json()
    assert (body["kind"], body["app"], body["idle_minutes"]) == ("interactive", "jupyter", 60)
    assert body["max_duration_seconds"] == 12 * 3600 == body["timeout_seconds"]
    assert "app_token" not in body and "token" not in str(body)
    task = Task.objects.get(pk=body["id"])
    assert len(task.app_token) >= 40
    Task.objects.filter(pk=task.pk).update(node=Node.objects.create(id="n1", name="n1"))
    seen = api.get(f"/api/v1/tasks/{task.pk}?node_id=n1", **AGENT).json()
    assert seen["app_token"] == task.app_token
    other = create(api, world, NOTEBOOK | {"app": "shell", "idle_minutes": 15, "max_hours": 2}).json()
    assert (other["app"], other["idle_minutes"], other["max_duration_seconds"]) == ("shell", 15, 7200)
    assert Task.objects.get(pk=other["id"]).app_token != task.app_token


def test_the_tenant_sets_the_default_and_the_ceiling(api, world):
    Tenant.objects.filter(slug="acme").update(interactive_idle_minutes=20, interactive_idle_minutes_max=90)
    assert create(api, world, NOTEBOOK).json()["idle_minutes"] == 20
    before = Task.objects.count()
    answer = create(api, world, NOTEBOOK | {"idle_minutes": 91})
    assert answer.status_code == 400
    assert answer.json()["error"]["fields"]["idle_minutes"] == ["At most 90 minutes in tenant 'acme'."]
    assert Task.objects.count() == before


@pytest.mark.parametrize(
    "body,field,words",
    [
        (NOTEBOOK | {"command": ["python", "x.py"]}, "command", "runs its app; give no command"),
        (NOTEBOOK | {"max_hours": 2, "max_duration_seconds": 60}, "max_hours", "not both"),
        (NOTEBOOK | {"app": "vscode"}, "app", "not a valid choice"),
        (NOTEBOOK | {"idle_minutes": 0}, "idle_minutes", "greater than or equal to 1"),
        ({**NOTEBOOK, "kind": "job", "app": "jupyter"}, "app", "Only interactive tasks"),
        ({**NOTEBOOK, "kind": "job", "idle_minutes": 5}, "idle_minutes", "Only interactive tasks"),
        ({k: v for k, v in NOTEBOOK.items() if k != "image"}, "image", "required"),
    ],
)
def test_bad_input_is_400_and_nothing_is_written(api, world, body, field, words):
    before = Task.objects.count()
    answer = create(api, world, body)
    assert answer.status_code == 400 and words in str(answer.json()["error"]["fields"][field]), answer.json()
    assert Task.objects.count() == before


def test_the_image_may_be_left_out_where_the_operator_set_one_per_vendor(api, world, settings):
    settings.HETEROFLOW_INTERACTIVE_IMAGES = {"nvidia": "registry.local/nb-cuda:1", "default": "registry.local/nb:1"}
    body = create(api, world, {k: v for k, v in NOTEBOOK.items() if k != "image"}).json()
    assert body["image"] == ""
    node = make_node("n-nv", gpus=1)
    Task.objects.filter(pk=body["id"]).update(node=node)
    assert api.get(f"/api/v1/tasks/{body['id']}?node_id=n-nv", **AGENT).json()["image"] == "registry.local/nb-cuda:1"
    Task.objects.filter(pk=body["id"]).update(node=make_node("n-asc", gpus=1, vendor="ascend"))
    assert api.get(f"/api/v1/tasks/{body['id']}?node_id=n-asc", **AGENT).json()["image"] == "registry.local/nb:1"


def test_a_notebook_gets_a_host_port_at_bind_and_its_app_is_shown_to_those_who_may_enter(api, world):
    make_node("n1", gpus=2)
    notebook = create(api, world, NOTEBOOK).json()
    shell = create(api, world, NOTEBOOK | {"app": "shell"}).json()
    job = create(api, world, {"name": "j", "image": "x", "gpu_required": 0}).json()

    def app(task_id, who="acme-member"):
        return api.get(f"/api/v1/tasks/{task_id}/app", **bearer(world.keys[who]))

    assert app(notebook["id"]).json()["error"]["code"] == "task_not_running"  # still pending: 409
    assert set(run_cycle().bound) >= {notebook["id"], shell["id"], job["id"]}
    Task.objects.filter(pk__in=[notebook["id"], shell["id"], job["id"]]).update(status="running")
    task = Task.objects.get(pk=notebook["id"])
    assert task.host_port is not None
    assert Task.objects.get(pk=job["id"]).host_port is None
    answer = app(notebook["id"])
    assert answer.status_code == 200
    assert answer.json() == {
        "app": "jupyter",
        "port": task.host_port,
        "path": f"/apps/{task.pk}/",
        "token": task.app_token,
    }
    assert app(shell["id"]).json() == {"app": "shell", "port": None, "path": None, "token": None}
    assert app(job["id"]).status_code == 409
    assert app(notebook["id"], "acme-viewer").status_code == 403
    assert app(notebook["id"], "beta-member").status_code == 404


def test_an_operator_sets_a_tenants_default_within_its_ceiling(api, world):
    op = bearer(world.operator_key)
    answer = api.patch(
        "/api/v1/tenants/acme",
        {"interactive_idle_minutes": 30, "interactive_idle_minutes_max": 120},
        format="json",
        **op,
    )
    assert answer.status_code == 200, answer.json()
    assert (answer.json()["interactive_idle_minutes"], answer.json()["interactive_idle_minutes_max"]) == (30, 120)
    refused = api.patch("/api/v1/tenants/acme", {"interactive_idle_minutes": 121}, format="json", **op)
    assert refused.status_code == 400
    assert "over the ceiling (120)" in str(refused.json()["error"]["fields"]["interactive_idle_minutes"])
    assert Tenant.objects.get(slug="acme").interactive_idle_minutes == 30
