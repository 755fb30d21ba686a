"""The inference pages with Django's test client: the deploy form says what the API says
and writes nothing on an error; the list and the detail are scoped as the API is; the
detail shows each replica on its node with its port, health and address, the window and
whether it holds, and the decisions with their reasons; scale, stop and wake are POSTs
with the CSRF token, through the same actions as the API."""

import re

import pytest
from django.test import Client
from django.utils.html import escape

from apps.inference.models import InferenceService, ServiceDecision
from apps.tasks.models import Task, TaskGroup
from tests.factories import make_node
from tests.headers import bearer
from tests.inference.service_rows import decide, make_model, make_service
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db

FORM = {
    "name": "chat",
    "model": "qwen3-8b",
    "engine": "auto",
    "gpu_type": "nvidia",
    "gpus_per_replica": "1",
    "min_replicas": "1",
    "max_replicas": "3",
    "sleep_after_seconds": "900",
    "autoscaling": '{"target_in_flight": 4}',
    "window_on": "1",
    "window_days": ["mon", "tue", "wed", "thu", "fri"],
    "window_ranges": "09:00-12:00\n13:00-18:00",
    "window_timezone": "Asia/Shanghai",
    "window_action": "scale",
    "window_scale_to": "1",
    "engine_args": "--max-model-len\n8192",
    "env": "HF_HUB_OFFLINE=1",
    "labels": "zone=az1",
}


def written():
    return (
        InferenceService.objects.count(),
        TaskGroup.objects.count(),
        Task.objects.count(),
        ServiceDecision.objects.count(),
    )


@pytest.fixture
def models(world):
    return {"acme": make_model(world.tenants["acme"]), "beta": make_model(world.tenants["beta"], "beta-only")}


@pytest.mark.parametrize("url", ["/portal/inference/", "/portal/inference/new/", "/portal/inference/1/"])
def test_an_anonymous_visitor_is_sent_to_the_sign_in_page(client, url):
    response = client.get(url)
    assert response.status_code == 302 and response["Location"].startswith("/portal/login/?next=")


def test_deploying_through_the_form(client, world, models):
    member = signed_in(client, world.users["acme-member"])
    html = page(member, "/portal/inference/new/")
    assert 'id="inference-form"' in html and '<option value="qwen3-8b">qwen3-8b · safetensors</option>' in html
    assert "beta-only" not in html  # another tenant's model is not offered
    response = member.post("/portal/inference/new/", FORM)
    assert response.status_code == 302, response.content.decode()
    service = InferenceService.objects.select_related("group").get(group__name="chat")
    assert response["Location"] == f"/portal/inference/{service.pk}/"
    assert (service.model, service.min_replicas, service.max_replicas, service.sleep_after_seconds) == (
        models["acme"],
        1,
        3,
        900,
    )
    assert service.autoscaling == {"target_in_flight": 4} and service.engine_args == ["--max-model-len", "8192"]
    assert service.window == {
        "days": ["mon", "tue", "wed", "thu", "fri"],
        "ranges": [{"start": "09:00", "end": "12:00"}, {"start": "13:00", "end": "18:00"}],
        "timezone": "Asia/Shanghai",
        "action": "scale",
        "scale_to": 1,
    }
    assert service.group.env == {"HF_HUB_OFFLINE": "1"} and service.group.labels == {"zone": "az1"}
    html = page(member, response["Location"])
    assert f"Service #{service.pk} &#x27;chat&#x27; deployed" in html and "data-window" in html


def test_without_a_window_ticked_there_is_none(client, world, models):
    member = signed_in(client, world.users["acme-member"])
    form = {key: value for key, value in FORM.items() if key != "window_on"}
    assert member.post("/portal/inference/new/", form).status_code == 302
    assert InferenceService.objects.get().window is None


def test_a_memory_share_service_is_deployed_through_the_form_and_needs_its_memory(client, world, models):
    member = signed_in(client, world.users["acme-member"])
    assert "each replica takes a share of one card" in page(member, "/portal/inference/new/")
    share = FORM | {"gpus_per_replica": "0", "gpu_memory_mb": "16384"}
    before = written()
    html = member.post("/portal/inference/new/", share | {"gpu_memory_mb": ""}).content.decode()
    assert "Required with gpus_per_replica 0" in html and written() == before  # refused, nothing written
    assert member.post("/portal/inference/new/", share).status_code == 302
    replica = Task.objects.get(group__name="chat")
    assert (replica.gpu_required, replica.gpu_memory_mb) == (0, 16384)


def test_the_form_says_what_the_api_says_and_writes_nothing(client, world, models, api):
    bad = {
        "name": "",
        "model": "nope",
        "gpu_type": "tpu",
        "min_replicas": 0,
        "sleep_after_seconds": 5,
        "env": {"1BAD": "x"},
        "window": {
            "days": ["mon"],
            "ranges": [{"start": "25:00", "end": "18:00"}],
            "timezone": "UTC",
            "action": "pause",
        },
    }
    api_fields = api.post("/api/v1/inference-services", bad, format="json", **bearer(world.keys["acme-member"])).json()[
        "error"
    ]["fields"]
    assert set(api_fields) == {"name", "gpu_type", "min_replicas", "sleep_after_seconds", "env", "window"}
    before = written()
    member = signed_in(client, world.users["acme-member"])
    form = FORM | {
        "name": "",
        "gpu_type": "tpu",
        "min_replicas": "0",
        "sleep_after_seconds": "5",
        "env": "1BAD=x",
        "window_days": ["mon"],
        "window_ranges": "25:00-18:00",
        "window_timezone": "UTC",
        "window_action": "pause",
        "window_scale_to": "",
        "autoscaling": "",
    }
    response = member.post("/portal/inference/new/", form)
    assert response.status_code == 400
    html = response.content.decode()
    assert "The service was not deployed." in html
    for field, messages in api_fields.items():
        for message in messages:
            assert f'data-errors="{field}"' in html and escape(message) in html, (field, message)
    # the model is checked once the fields are right, as the API does
    html = member.post("/portal/inference/new/", FORM | {"model": "beta-only"}).content.decode()
    assert escape("Tenant 'acme' has no model named 'beta-only' (register it first).") in html
    # a policy that is not JSON is said so, with the API's other problems
    html = member.post(
        "/portal/inference/new/", FORM | {"autoscaling": "{target: 4", "gpu_type": "tpu"}
    ).content.decode()
    assert 'data-errors="autoscaling"' in html and "Not JSON" in html and 'data-errors="gpu_type"' in html
    assert written() == before


def test_operators_name_the_tenant_and_viewers_get_no_form(client, world, models):
    operator = signed_in(client, world.operator)
    assert "beta-only (beta)" in page(operator, "/portal/inference/new/")
    html = operator.post("/portal/inference/new/", FORM).content.decode()
    assert "Required: the slug of the tenant the service runs for." in html
    html = operator.post("/portal/inference/new/", FORM | {"tenant": "nope"}).content.decode()
    assert '<ul class="errorlist" data-errors="tenant"><li>Not found.</li>' in html
    html = operator.post("/portal/inference/new/", FORM | {"tenant": "nope", "autoscaling": "{"}).content.decode()
    assert '<ul class="errorlist" data-errors="tenant"><li>Not found.</li>' in html
    assert operator.post("/portal/inference/new/", FORM | {"tenant": "beta", "model": "beta-only"}).status_code == 302
    assert InferenceService.objects.get().group.tenant == world.tenants["beta"]
    viewer = signed_in(client, world.users["acme-viewer"])
    page(viewer, "/portal/inference/new/", 403)
    assert viewer.post("/portal/inference/new/", FORM).status_code == 403
    assert "Deploy a service" not in page(viewer, "/portal/inference/")


def test_the_list_is_scoped_filtered_and_linked_from_the_nav(client, world, models):
    ours = make_service(world.tenants["acme"], models["acme"], name="acme-chat", state="running")
    asleep = make_service(world.tenants["acme"], models["acme"], name="acme-night", state="sleeping")
    theirs = make_service(world.tenants["beta"], models["beta"], name="beta-chat")
    member = signed_in(client, world.users["acme-member"])
    html = page(member, "/portal/inference/")
    assert 'href="/portal/inference/" aria-current="page">Inference</a>' in html and "Deploy a service" in html
    assert re.findall(r'<tr data-service="(\d+)"', html) == [str(asleep.pk), str(ours.pk)]
    assert re.findall(r'<tr data-service="(\d+)"', page(member, "/portal/inference/?state=sleeping")) == [
        str(asleep.pk)
    ]
    assert len(re.findall(r'<tr data-service="(\d+)"', page(member, "/portal/inference/?state=nonsense"))) == 2
    page(member, f"/portal/inference/{theirs.pk}/", 404)
    for action in ("scale", "stop", "wake"):
        assert member.post(f"/portal/inference/{theirs.pk}/{action}/", {"replicas": "1"}).status_code == 404
    assert InferenceService.objects.get(pk=theirs.pk).state == "starting"
    operator = signed_in(client, world.operator)
    assert str(theirs.pk) in re.findall(r'<tr data-service="(\d+)"', page(operator, "/portal/inference/"))


def test_the_detail_shows_replicas_window_and_decisions(client, world, models):
    node = make_node("gpu-01", 4, name="alpha", ip="10.0.0.5")
    always = {
        "days": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"],
        "ranges": [{"start": "00:00", "end": "24:00"}],
        "timezone": "UTC",
        "action": "pause",
    }
    service = make_service(
        world.tenants["acme"], models["acme"], replicas=2, status="running", node=node, state="running", window=always
    )
    first, second = service.group.tasks.order_by("rank")
    node.task_health = [{"task_id": first.pk, "healthy": True}, {"task_id": second.pk, "healthy": False}]
    node.save(update_fields=["task_health"])
    decide(service, reason="in flight 37 over 3 replicas = 12.3 > target 8: up to 5", from_replicas=1, to_replicas=2)
    html = page(signed_in(client, world.users["acme-viewer"]), f"/portal/inference/{service.pk}/")
    rows = dict(re.findall(r'<tr data-rank="(\d)">.*?data-health="(\w+)"', html, re.S))
    assert rows == {"0": "healthy", "1": "unhealthy"}
    assert '<a href="/portal/nodes/gpu-01/">alpha</a>' in html and "<code>http://10.0.0.5:8000</code>" in html
    assert "2 asked, 1 healthy" in html
    assert "in flight 37 over 3 replicas = 12.3 &gt; target 8: up to 5" in html and "1 → 2" in html
    assert 'data-window-inside="yes"' in html and 'data-window-holds="no"' in html
    assert "Scale</button>" not in html and "Stop</button>" not in html  # viewers look only


def test_a_held_window_is_said_and_blocks_the_scale_form(client, world, models):
    window = {
        "days": ["mon"],
        "ranges": [{"start": "09:00", "end": "10:00"}],
        "timezone": "UTC",
        "action": "scale",
        "scale_to": 1,
    }
    service = make_service(
        world.tenants["acme"],
        models["acme"],
        replicas=1,
        max_replicas=3,
        state="running",
        window=window,
        window_action="scale",
        window_remembered=3,
    )
    html = page(signed_in(client, world.users["acme-member"]), f"/portal/inference/{service.pk}/")
    assert 'data-window-holds="yes"' in html and "restores 3 replicas back inside" in html
    assert 'id="scale-form"' not in html and "Its scheduling window holds the replica count" in html


def test_scale_stop_and_wake_are_posts_with_the_csrf_token(world, models):
    service = make_service(world.tenants["acme"], models["acme"], replicas=1, max_replicas=3, state="running")
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(world.users["acme-member"])
    url = f"/portal/inference/{service.pk}/"
    html = page(browser, url)
    assert 'id="scale-form"' in html and "Stop</button>" in html and "Wake</button>" not in html
    assert browser.get(f"{url}scale/").status_code == 405
    assert browser.post(f"{url}scale/", {"replicas": "2"}).status_code == 403  # no token
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html).group(1)
    html = browser.post(f"{url}scale/", {"replicas": "9", "csrfmiddlewaretoken": token}, follow=True).content.decode()
    assert "Between min_replicas (1) and max_replicas (3)" in html
    html = browser.post(f"{url}scale/", {"replicas": "x", "csrfmiddlewaretoken": token}, follow=True).content.decode()
    assert "Replicas: a whole number." in html
    html = browser.post(f"{url}scale/", {"replicas": "2", "csrfmiddlewaretoken": token}, follow=True).content.decode()
    assert f"Service #{service.pk} asks for 2 replicas." in html
    assert InferenceService.objects.get(pk=service.pk).replicas == 2
    html = browser.post(f"{url}stop/", {"csrfmiddlewaretoken": token}, follow=True).content.decode()
    assert re.search(rf"Service #{service.pk} is stopp(ing|ed)\.", html) and "Stop</button>" not in html


def test_wake_through_the_page(client, world, models):
    asleep = make_service(
        world.tenants["acme"], models["acme"], status="sleeping", state="sleeping", node=make_node("n1", 2)
    )
    member = signed_in(client, world.users["acme-member"])
    html = page(member, f"/portal/inference/{asleep.pk}/")
    assert "Wake</button>" in html and 'id="scale-form"' in html  # a sleeping service's count may change
    html = member.post(f"/portal/inference/{asleep.pk}/wake/", follow=True).content.decode()
    assert f"Service #{asleep.pk} is waking." in html
    stopped = make_service(world.tenants["acme"], models["acme"], name="old", replicas=0, state="stopped")
    html = member.post(f"/portal/inference/{stopped.pk}/wake/", follow=True).content.decode()
    assert 'class="error"' in html


def test_viewers_cannot_act(client, world, models):
    service = make_service(world.tenants["acme"], models["acme"], state="running")
    viewer = signed_in(client, world.users["acme-viewer"])
    for action in ("scale", "stop", "wake"):
        assert viewer.post(f"/portal/inference/{service.pk}/{action}/", {"replicas": "1"}).status_code == 403
    assert InferenceService.objects.get(pk=service.pk).state == "running"


def test_a_services_group_is_not_listed_as_training(client, world, models):
    service = make_service(world.tenants["acme"], models["acme"], name="chat")
    html = page(signed_in(client, world.users["acme-member"]), "/portal/training/")
    assert f'<tr data-group="{service.pk}"' not in html and "No training groups." in html
