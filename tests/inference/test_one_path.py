"""Each user action on inference has one home, which the API and the portal both go
through, and which asks the policy (apps.tenants.policy) once: a model's deletion
(apps.inference.model_deletion.delete_model) and a service's scale, stop and wake
(apps.inference.services)."""

import functools
import inspect

import pytest
from django.test import Client

from apps.inference import model_deletion, services
from apps.inference.models import InferenceService, Model
from apps.tenants import policy
from tests.factories import make_node
from tests.headers import bearer
from tests.inference.service_rows import make_model, make_service

pytestmark = pytest.mark.django_db


@pytest.fixture
def asked(monkeypatch):
    """The policy's questions asked from outside it (its functions asking each other not counted)."""
    calls, depth = [], [0]

    def counted(name, function):
        @functools.wraps(function)
        def ask(*args, **kwargs):
            if depth[0] == 0:
                calls.append(name)
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1

        return ask

    for name, function in inspect.getmembers(policy, inspect.isfunction):
        if function.__module__ == policy.__name__:
            monkeypatch.setattr(policy, name, counted(name, function))
    return calls


@pytest.fixture
def spied(monkeypatch):
    """The calls of the one delete_model."""
    calls = []
    real = model_deletion.delete_model

    def delete_model(principal, model):
        calls.append(model.pk)
        return real(principal, model)

    monkeypatch.setattr(model_deletion, "delete_model", delete_model)
    return calls


def member_browser(world) -> Client:
    browser = Client()
    browser.force_login(world.users["acme-member"])
    return browser


def test_the_api_and_the_portal_delete_a_model_through_one_delete_model(api, world, spied, asked):
    by_api, by_portal = make_model(world.tenants["acme"], "by-api"), make_model(world.tenants["acme"], "by-portal")
    assert api.delete(f"/api/v1/models/{by_api.pk}", **bearer(world.keys["acme-member"])).status_code == 204
    assert asked == ["check_may_manage_models"]
    response = member_browser(world).post(f"/portal/models/{by_portal.pk}/delete/")
    assert response.status_code == 302
    assert spied == [by_api.pk, by_portal.pk] and not Model.objects.filter(pk__in=spied).exists()
    assert asked == ["check_may_manage_models"] * 2


def test_a_viewer_is_refused_by_the_one_delete_model(api, world, spied):
    model = make_model(world.tenants["acme"])
    assert api.delete(f"/api/v1/models/{model.pk}", **bearer(world.keys["acme-viewer"])).status_code == 403
    assert spied == [model.pk] and Model.objects.filter(pk=model.pk).exists()


@pytest.mark.parametrize(
    "action,body,state",
    [("scale", {"replicas": 2}, "running"), ("stop", {}, "running"), ("wake", {}, "sleeping")],
)
def test_the_api_asks_the_policy_once_per_action(api, world, asked, action, body, state):
    service = make_service(
        world.tenants["acme"], make_model(world.tenants["acme"]), replicas=1, max_replicas=3, state=state
    )
    url = f"/api/v1/inference-services/{service.pk}/{action}"
    response = api.post(url, body, format="json", **bearer(world.keys["acme-member"]))
    assert response.status_code == 200, response.content
    assert asked == ["check_may_stop_task"]


@pytest.mark.parametrize(
    "action,form,state", [("scale", {"replicas": "2"}, "running"), ("stop", {}, "running"), ("wake", {}, "sleeping")]
)
def test_the_portal_asks_the_policy_once_per_action(world, asked, action, form, state):
    service = make_service(
        world.tenants["acme"],
        make_model(world.tenants["acme"]),
        replicas=1,
        max_replicas=3,
        state=state,
        node=make_node("n1", 2),
    )
    before = InferenceService.objects.get(pk=service.pk)
    response = member_browser(world).post(f"/portal/inference/{service.pk}/{action}/", form)
    assert response.status_code == 302
    after = InferenceService.objects.get(pk=service.pk)
    assert (after.state, after.replicas) != (before.state, before.replicas)  # the action was done
    assert asked == ["check_may_stop_task"]


@pytest.mark.parametrize("action", ["scale", "stop", "wake"])
def test_api_and_portal_run_the_same_service(api, world, monkeypatch, action):
    service = make_service(world.tenants["acme"], make_model(world.tenants["acme"]), replicas=1, max_replicas=3)
    name = {"scale": "scale_by_user", "stop": "stop_service", "wake": "wake_service"}[action]
    seen = []
    monkeypatch.setattr(services, name, lambda principal, svc, *rest: seen.append((principal.tenant.pk, svc.pk)))
    body = {"replicas": 2} if action == "scale" else {}
    url = f"/api/v1/inference-services/{service.pk}/{action}"
    assert api.post(url, body, format="json", **bearer(world.keys["acme-member"])).status_code == 200
    assert member_browser(world).post(f"/portal/inference/{service.pk}/{action}/", body).status_code == 302
    assert seen == [(world.tenants["acme"].pk, service.pk)] * 2
