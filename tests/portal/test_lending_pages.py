"""The portal shows training's loans of idle inference cards: the service page lists them
(borrower, node, replicas, state, why given back) and says whether it lends; the training
task's page says where it borrows while it waits and whose cards it holds once placed;
the deploy form's box opts a service out."""

import pytest
from django.test import Client

from apps.inference.models import InferenceService
from apps.scheduler.cycle import run_cycle
from apps.tasks.models import Task
from tests.factories import make_group, make_node, make_task
from tests.inference.lending_support import confirm, serving, wipe_signals
from tests.inference.service_rows import make_model
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def clean_signals():
    wipe_signals()
    yield
    wipe_signals()


def test_the_service_and_task_pages_show_the_loan(world):
    make_node("n1", gpus=2)
    chat = serving(world, replicas=2, min_replicas=1, max_replicas=2)
    train = make_task(world.tenants["acme"], name="train", kind="training", gpu_required=1, gpu_type="nvidia")
    run_cycle()
    client = signed_in(Client(), world.users["acme-member"])
    waiting = page(client, f"/portal/tasks/{train.pk}/")
    assert 'data-explanation="LoanPending"' in waiting and "data-loan-pending" in waiting
    assert f"chat (service {chat.pk}, 1 replica)" in waiting
    confirm(Task.objects.get(group_id=chat.pk, rank=1).pk, "stopping", "stopped")
    run_cycle()
    placed = page(client, f"/portal/tasks/{train.pk}/")
    assert "On cards lent by inference service" in placed and f"/portal/inference/{chat.pk}/" in placed
    detail = page(client, f"/portal/inference/{chat.pk}/")
    assert "Cards lent to training" in detail and f"#{train.pk} train" in detail
    assert "borrowed" in detail and f"training task {train.pk} (train)" in detail
    assert "data-lendable>yes" in detail
    # another tenant sees neither page
    other = signed_in(Client(), world.users["beta-member"])
    assert page(other, f"/portal/inference/{chat.pk}/", status=404)
    assert page(other, f"/portal/tasks/{train.pk}/", status=404)


def test_the_deploy_forms_box_opts_a_service_out(world):
    make_model(world.tenants["acme"])
    client = signed_in(Client(), world.users["acme-member"])
    form = {"name": "private", "model": "qwen3-8b", "gpu_type": "nvidia", "gpus_per_replica": "1", "not_lendable": "on"}
    response = client.post("/portal/inference/new/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    service = InferenceService.objects.get(group__name="private")
    assert service.lendable is False
    assert "data-lendable>no" in page(client, f"/portal/inference/{service.pk}/")


def test_the_training_group_page_shows_its_loan(world):
    make_node("n1", gpus=2)
    serving(world, replicas=2, min_replicas=1, max_replicas=2)
    gang = make_group(world.tenants["acme"], workers=2, gpus=1, name="gang", kind="training")
    run_cycle()
    client = signed_in(Client(), world.users["acme-member"])
    shown = page(client, f"/portal/training/{gang.pk}/")
    assert 'data-waiting="LoanPending"' in shown and "Borrowing cards lent by inference service" in shown
