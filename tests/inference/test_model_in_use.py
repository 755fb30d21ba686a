"""The model deletion's pre-check: a model that a service not yet stopped uses is 409
`model_in_use` naming the services (the foreign key is RESTRICT: never a 500) on the API
and the portal, and nothing is deleted (the admin's confirmation page lists the protected
services); a model only stopped services used is deleted with their records, their groups
and tasks staying as history. And the services' admin: read-only, the latest decisions
inline."""

import pytest

from apps.core.principals import Principal, PrincipalKind
from apps.inference import model_deletion
from apps.inference.models import InferenceService, Model, ServiceDecision
from apps.tasks.models import Task, TaskGroup
from apps.tenants.choices import Role
from tests.headers import bearer
from tests.inference.service_rows import decide, make_model, make_service
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db

URL = "/api/v1/models"


@pytest.mark.parametrize("state", ["starting", "running", "sleeping", "waking", "paused", "stopping"])
def test_a_model_a_live_service_uses_is_409_naming_it(api, world, state):
    model = make_model(world.tenants["acme"])
    service = make_service(world.tenants["acme"], model, name="chat", state=state)
    response = api.delete(f"{URL}/{model.pk}", **bearer(world.keys["acme-member"]))
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "model_in_use"
    assert error["message"] == (
        f"Model 'qwen3-8b' is used by 1 service: 'chat' (#{service.pk}, {state}). "
        "Stop them first; a stopped service does not hold its model."
    )
    assert Model.objects.filter(pk=model.pk).exists() and InferenceService.objects.filter(pk=service.pk).exists()


def test_every_live_service_is_named_and_a_stopped_one_is_not(api, world):
    model = make_model(world.tenants["acme"])
    make_service(world.tenants["acme"], model, name="b-chat", state="running")
    make_service(world.tenants["acme"], model, name="a-chat", state="sleeping")
    make_service(world.tenants["acme"], model, name="old", replicas=0, state="stopped")
    message = api.delete(f"{URL}/{model.pk}", **bearer(world.keys["acme-member"])).json()["error"]["message"]
    assert message.startswith("Model 'qwen3-8b' is used by 2 services: 'a-chat'") and "'b-chat'" in message
    assert "'old'" not in message
    assert InferenceService.objects.count() == 3  # the stopped one's record stays too: nothing was deleted


def test_a_model_only_stopped_services_used_goes_with_their_records(api, world):
    model = make_model(world.tenants["acme"])
    old = make_service(world.tenants["acme"], model, name="old", replicas=1, status="stopped", state="stopped")
    decide(old, source="user", action="stop")
    group, tasks = old.group_id, list(old.group.tasks.values_list("pk", flat=True))
    assert api.delete(f"{URL}/{model.pk}", **bearer(world.keys["acme-member"])).status_code == 204
    assert not Model.objects.filter(pk=model.pk).exists()
    assert not InferenceService.objects.filter(pk=old.pk).exists() and not ServiceDecision.objects.exists()
    assert (
        TaskGroup.objects.filter(pk=group).exists()
        and list(Task.objects.filter(group=group).values_list("pk", flat=True)) == tasks
    )


def test_viewers_are_refused_before_the_check(api, world):
    model = make_model(world.tenants["acme"])
    make_service(world.tenants["acme"], model, state="running")
    assert api.delete(f"{URL}/{model.pk}", **bearer(world.keys["acme-viewer"])).status_code == 403


def test_a_model_deleted_meanwhile_is_done(world):
    model = make_model(world.tenants["acme"])
    Model.objects.filter(pk=model.pk).delete()
    member = Principal(
        PrincipalKind.TENANT_USER, user=world.users["acme-member"], tenant=world.tenants["acme"], role=Role.MEMBER
    )
    assert model_deletion.delete_model(member, model) == []


def test_the_portal_says_which_services_hold_it_and_keeps_it(client, world):
    model = make_model(world.tenants["acme"])
    make_service(world.tenants["acme"], model, name="chat", state="running")
    browser = signed_in(client, world.users["acme-member"])
    response = browser.post(f"/portal/models/{model.pk}/delete/", follow=True)
    html = response.content.decode()
    assert response.redirect_chain[-1][0] == f"/portal/models/{model.pk}/"
    assert "is used by 1 service: &#x27;chat&#x27;" in html and Model.objects.filter(pk=model.pk).exists()
    service = InferenceService.objects.get(model=model)
    assert (
        f'<tr data-service="{service.pk}"><td><a href="/portal/inference/{service.pk}/">#{service.pk} chat</a>' in html
    )


def test_the_admin_refuses_naming_the_services_never_a_500(client, world):
    model = make_model(world.tenants["acme"])
    service = make_service(world.tenants["acme"], model, name="chat", state="running")
    decide(service, reason="in flight 37 over 3 replicas = 12.3 > target 8: up to 5")
    admin = signed_in(client, world.operator)
    html = page(admin, f"/admin/inference/model/{model.pk}/delete/")  # the confirmation lists what protects it
    assert "protected related objects" in html and "Inference service: chat (qwen3-8b, 2 replicas, running)" in html
    response = admin.post(f"/admin/inference/model/{model.pk}/delete/", {"post": "yes"}, follow=True)
    assert response.redirect_chain[-1][0] == f"/admin/inference/model/{model.pk}/change/"
    assert "is used by 1 service: &#x27;chat&#x27;" in response.content.decode()
    assert "delete_selected" not in page(admin, "/admin/inference/model/")  # no bulk delete past the check
    assert Model.objects.filter(pk=model.pk).exists()
    html = page(admin, f"/admin/inference/inferenceservice/{service.pk}/change/")
    assert "in flight 37 over 3 replicas" in html and "chat" in html
    listing = page(admin, "/admin/inference/inferenceservice/?state__exact=running")
    assert "chat" in listing and "1–2" in listing
    assert admin.get("/admin/inference/inferenceservice/add/").status_code == 403
    assert admin.get(f"/admin/inference/inferenceservice/{service.pk}/delete/").status_code == 403


def test_the_admin_deletes_a_model_only_stopped_services_used(client, world):
    model = make_model(world.tenants["acme"])
    old = make_service(world.tenants["acme"], model, name="old", replicas=0, state="stopped")
    admin = signed_in(client, world.operator)
    html = page(admin, f"/admin/inference/model/{model.pk}/delete/")
    assert "Are you sure" in html and "Cannot delete" not in html
    admin.post(f"/admin/inference/model/{model.pk}/delete/", {"post": "yes"})
    assert not Model.objects.filter(pk=model.pk).exists() and not InferenceService.objects.filter(pk=old.pk).exists()


def test_the_admin_shows_a_services_latest_hundred_decisions_whatever_the_others(client, world):
    model = make_model(world.tenants["acme"])
    quiet = make_service(world.tenants["acme"], model, name="quiet", state="running")
    busy = make_service(world.tenants["acme"], model, name="busy", state="running")
    decide(quiet, reason="the quiet one's only decision")
    for number in range(105):
        decide(busy, reason=f"busy decision {number:03}")
    admin = signed_in(client, world.operator)
    assert "the quiet one&#x27;s only decision" in page(admin, f"/admin/inference/inferenceservice/{quiet.pk}/change/")
    html = page(admin, f"/admin/inference/inferenceservice/{busy.pk}/change/")
    assert "busy decision 104" in html and "busy decision 005" in html and "busy decision 004" not in html


def test_a_tenant_with_services_and_their_models_can_be_deleted():
    """The model's foreign key is RESTRICT, not PROTECT: a model cannot go alone while a
    service holds it, but its tenant's deletion takes the tenant's models and services
    together (it was a 500)."""
    from apps.tenants.models import Tenant
    from apps.tenants.services import create_tenant, delete_tenant

    tenant = create_tenant(name="Gone", slug="gone")
    model = make_model(tenant)
    make_service(tenant, model, name="chat", state="stopped")
    Task.objects.filter(tenant=tenant).update(status="stopped")  # a tenant with live tasks is refused anyway
    delete_tenant(tenant)
    assert not Tenant.objects.filter(slug="gone").exists()
    assert not Model.objects.filter(pk=model.pk).exists() and not InferenceService.objects.exists()
