"""The agent's model-ensure reports (apps.inference.model_ensure, POST
/api/v1/inference-replicas/{task}/model-ensure): a download's progress shows on the
service page and fades when it ends, its end and its failure land in the service's
decisions; the channel is the agent's alone, for a task on the reporting node; a
replica carries its model's source kind so that the agent knows how to ensure it."""

import pytest
from django.core.cache import cache

from apps.inference import model_ensure
from apps.inference.models import ServiceDecision
from tests.factories import make_node
from tests.headers import AGENT, bearer
from tests.inference.service_rows import make_model, make_service
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db


@pytest.fixture
def replica(world):
    node = make_node("gpu-01", 2, name="alpha")
    model = make_model(world.tenants["acme"], "tiny", source_kind="hub", source="org/tiny", format="gguf")
    service = make_service(world.tenants["acme"], model, replicas=1, status="running", node=node, state="starting")
    task = service.group.tasks.get()
    yield service, task
    cache.delete(model_ensure.progress_key(task.pk))


def url(task) -> str:
    return f"/api/v1/inference-replicas/{task.pk}/model-ensure"


def post(api, task, **body):
    return api.post(url(task), {"node_id": "gpu-01", **body}, format="json", **AGENT)


def test_progress_shows_on_the_service_page_and_its_end_is_a_decision(api, client, world, replica):
    service, task = replica
    answer = post(
        api,
        task,
        state="fetching",
        model="tiny",
        bytes_done=50 * 2**20,
        bytes_total=200 * 2**20,
        bytes_per_second=10 * 2**20,
        eta_seconds=15,
    )
    assert answer.status_code == 204
    assert not ServiceDecision.objects.filter(service=service, source="ensure").exists()  # progress is not history
    viewer = signed_in(client, world.users["acme-viewer"])
    html = page(viewer, f"/portal/inference/{service.pk}/")
    line = html.split('data-fetching="0">', 1)[1].split("</p>", 1)[0]
    assert "fetching model tiny on gpu-01: 50.0\xa0MB of 200.0\xa0MB (25%), 10.0\xa0MB/s, about 15 s left" in line

    member = bearer(world.keys["acme-member"])
    (shown,) = api.get(f"/api/v1/inference-services/{service.pk}", **member).json()["members"]
    assert shown["model_fetch"] == {
        "model": "tiny",
        "node_id": "gpu-01",
        "bytes_done": 50 * 2**20,
        "bytes_total": 200 * 2**20,
        "bytes_per_second": 10.0 * 2**20,
        "eta_seconds": 15.0,
    }

    assert post(api, task, state="ready", model="tiny", bytes_done=200 * 2**20, seconds=20.5).status_code == 204

    assert "data-fetching" not in page(viewer, f"/portal/inference/{service.pk}/")
    assert api.get(f"/api/v1/inference-services/{service.pk}", **member).json()["members"][0]["model_fetch"] is None
    decision = ServiceDecision.objects.get(service=service, source="ensure")
    assert decision.action == "model_fetched"
    where = f"replica 0 (task {task.pk}) on node gpu-01"
    assert decision.reason == f"model tiny fetched for {where}: 209715200 bytes in 20.5 s"
    listed = api.get(f"/api/v1/inference-services/{service.pk}/decisions?source=ensure", **member)
    assert [d["action"] for d in listed.json()["results"]] == ["model_fetched"]


def test_a_failure_says_why_in_the_services_decisions(api, replica):
    service, task = replica
    post(api, task, state="fetching", bytes_done=1, bytes_total=10)
    why = "model tiny: http://mirror/org/tiny/tiny.gguf: checksum mismatch (sha256 ab…, the listing says cd…)"
    assert post(api, task, state="failed", model="tiny", message=why).status_code == 204
    decision = ServiceDecision.objects.get(service=service, source="ensure")
    assert decision.action == "ensure_failed"
    assert decision.reason == f"replica 0 (task {task.pk}) on node gpu-01 could not get its model: {why}"
    assert model_ensure.progress_of([task.pk]) == {}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"state": "failed"}, "message"),
        ({"state": "failed", "message": "  "}, "message"),
        ({"state": "done"}, "state"),
        ({"state": "fetching", "bytes_done": -1}, "bytes_done"),
    ],
)
def test_a_bad_report_is_refused_and_writes_nothing(api, replica, body, field):
    service, task = replica
    answer = post(api, task, **body)
    assert answer.status_code == 400 and field in str(answer.json())
    assert not ServiceDecision.objects.filter(service=service, source="ensure").exists()
    assert model_ensure.progress_of([task.pk]) == {}


def test_only_the_agent_of_the_replicas_node_reports(api, world, replica):
    service, task = replica
    make_node("gpu-02", 2)
    elsewhere = api.post(url(task), {"node_id": "gpu-02", "state": "failed", "message": "x"}, format="json", **AGENT)
    assert elsewhere.status_code == 404
    member = bearer(world.keys["acme-member"])
    person = api.post(url(task), {"node_id": "gpu-01", "state": "failed", "message": "x"}, format="json", **member)
    assert person.status_code == 403
    assert not ServiceDecision.objects.filter(service=service, source="ensure").exists()


def test_a_newer_agents_extra_field_is_ignored(api, replica):
    service, task = replica
    assert post(api, task, state="fetching", bytes_done=1, bytes_total=2, files_done=1).status_code == 204
    assert model_ensure.progress_of([task.pk])[task.pk]["bytes_done"] == 1
