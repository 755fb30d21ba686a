"""The training pages (task groups) with Django's test client: the form says what the API
says and writes nothing on an error; the list and the detail are scoped as the API is;
the detail shows the ranks on their nodes, the network decision and why a group waits;
stopping is a POST with the CSRF token, through the same service as the API's stop."""

import re

import pytest
from django.test import Client
from django.utils.html import escape

from apps.scheduler.services import run_cycle
from apps.tasks import services
from apps.tasks.models import Task, TaskGroup
from apps.tenants.models import Tenant
from apps.tenants.services import update_tenant
from tests.factories import make_group, make_node, make_task_holding
from tests.headers import bearer
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db

FORM = {
    "name": "llm",
    "strategy": "ddp",
    "world_size": "2",
    "gpus_per_worker": "2",
    "gpu_type": "nvidia",
    "image": "registry.local/trainer:2",
    "command": "torchrun\ntrain.py",
    "env": "EPOCHS=3",
    "volumes": "/data/ckpt:/ckpt\n/data/sets:/data:ro",
    "checkpoint_path": "/ckpt/llm",
    "labels": "zone=az1",
}


def written():
    return TaskGroup.objects.count(), Task.objects.count()


@pytest.mark.parametrize("url", ["/portal/training/", "/portal/training/new/", "/portal/training/1/"])
def test_an_anonymous_visitor_is_sent_to_the_sign_in_page(client, url):
    response = client.get(url)
    assert response.status_code == 302 and response["Location"].startswith("/portal/login/?next=")


def test_submitting_the_form_queues_the_group_with_its_ranked_workers(client, world):
    member = signed_in(client, world.users["acme-member"])
    html = page(member, "/portal/training/new/")
    assert 'id="training-form"' in html and 'name="csrfmiddlewaretoken"' in html
    response = member.post("/portal/training/new/", FORM)
    assert response.status_code == 302, response.content.decode()
    group = TaskGroup.objects.get(name="llm")
    assert response["Location"] == f"/portal/training/{group.pk}/"
    assert (group.tenant, group.world_size, group.gpus_per_worker, group.created_by) == (
        world.tenants["acme"],
        2,
        2,
        world.users["acme-member"],
    )
    assert group.volumes == [
        {"host": "/data/ckpt", "container": "/ckpt", "read_only": False},
        {"host": "/data/sets", "container": "/data", "read_only": True},
    ]
    workers = list(group.tasks.order_by("rank"))
    assert [(t.rank, t.command, t.env, t.labels) for t in workers] == [
        (rank, ["torchrun", "train.py"], {"EPOCHS": "3"}, {"zone": "az1"}) for rank in range(2)
    ]
    html = page(member, response["Location"])
    assert "queued: 2 workers" in html and "data-group-status>pending<" in html and 'data-waiting="waiting"' in html


def test_the_form_says_what_the_api_says_and_writes_nothing(client, world, api):
    bad = {"name": "", "world_size": 0, "gpus_per_worker": 0, "gpu_type": "tpu", "image": "x", "env": {"1BAD": "x"}}
    api_fields = api.post("/api/v1/task-groups", bad, format="json", **bearer(world.keys["acme-member"])).json()[
        "error"
    ]["fields"]
    assert set(api_fields) == {"name", "world_size", "gpus_per_worker", "gpu_type", "env"}
    before = written()
    member = signed_in(client, world.users["acme-member"])
    response = member.post(
        "/portal/training/new/",
        {"name": "", "world_size": "0", "gpus_per_worker": "0", "gpu_type": "tpu", "image": "x", "env": "1BAD=x"},
    )
    assert response.status_code == 400
    html = response.content.decode()
    assert "The group was not created." in html
    for field, messages in api_fields.items():
        for message in messages:
            assert f'data-errors="{field}"' in html and escape(message) in html, (field, message)
    bad_volume = member.post("/portal/training/new/", FORM | {"volumes": "/only-a-host"})
    assert bad_volume.status_code == 400 and 'data-errors="volumes"' in bad_volume.content.decode()
    assert written() == before


def test_a_group_over_the_quota_is_refused_whole_on_the_page(client, world):
    update_tenant(Tenant.objects.get(slug="acme"), max_gpus=3)  # a copy: the world's object outlives this test
    before = written()
    html = signed_in(client, world.users["acme-member"]).post("/portal/training/new/", FORM).content.decode()
    assert "Quota of tenant &#x27;acme&#x27; exceeded: 0 of 3 GPUs in use, 4 more asked." in html
    assert written() == before


def test_operators_name_the_tenant_and_viewers_get_no_form(client, world):
    operator = signed_in(client, world.operator)
    html = operator.post("/portal/training/new/", FORM).content.decode()
    assert "Required: the slug of the tenant" in html
    html = operator.post("/portal/training/new/", FORM | {"tenant": "nope"}).content.decode()
    assert '<ul class="errorlist" data-errors="tenant"><li>Not found.</li>' in html
    assert operator.post("/portal/training/new/", FORM | {"tenant": "beta"}).status_code == 302
    assert TaskGroup.objects.get(name="llm").tenant == world.tenants["beta"]
    viewer = signed_in(client, world.users["acme-viewer"])
    page(viewer, "/portal/training/new/", 403)
    assert viewer.post("/portal/training/new/", FORM).status_code == 403
    assert "New training group" not in page(viewer, "/portal/training/")


def test_the_list_is_scoped_filtered_and_linked_from_the_nav(client, world):
    ours = make_group(world.tenants["acme"], workers=2, gpus=1, name="acme-llm")
    stopped = make_group(world.tenants["acme"], workers=1, gpus=1, name="acme-old")
    services.stop_group(stopped)
    theirs = make_group(world.tenants["beta"], workers=2, gpus=1, name="beta-llm")
    member = signed_in(client, world.users["acme-member"])
    html = page(member, "/portal/training/")
    assert 'href="/portal/training/" aria-current="page">Training</a>' in html and "New training group" in html
    assert re.findall(r'<tr data-group="(\d+)"', html) == [str(stopped.pk), str(ours.pk)]
    assert re.findall(r'<tr data-group="(\d+)"', page(member, "/portal/training/?status=stopped")) == [str(stopped.pk)]
    assert re.findall(r'<tr data-group="(\d+)"', page(member, "/portal/training/?status=nonsense")) == [
        str(stopped.pk),
        str(ours.pk),
    ]
    page(member, f"/portal/training/{theirs.pk}/", 404)
    assert member.post(f"/portal/training/{theirs.pk}/stop/").status_code == 404
    assert {t.status for t in theirs.tasks.all()} == {"pending"}
    operator = signed_in(client, world.operator)
    assert str(theirs.pk) in re.findall(r'<tr data-group="(\d+)"', page(operator, "/portal/training/"))


def test_the_detail_shows_the_ranks_on_their_nodes_and_the_network_decision(client, world):
    make_node("n0", gpus=4, name="alpha")
    make_node("n1", gpus=4, name="bravo")
    group = make_group(world.tenants["acme"], workers=4, gpus=2, name="llm")
    assert run_cycle().groups_bound == [group.pk]
    html = page(signed_in(client, world.users["acme-viewer"]), f"/portal/training/{group.pk}/")
    nodes = dict(re.findall(r'<tr data-rank="(\d)">.*?data-rank-node><a href="/portal/nodes/(\w+)/"', html, re.S))
    assert nodes == {"0": "n0", "1": "n0", "2": "n1", "3": "n1"}
    group.refresh_from_db()
    assert f'data-network="{group.network["backend"]}"' in html
    assert group.network["reason"] in html and f":{group.network['master_port']}</code>" in html
    assert "Placed whole" in html and "on 2 nodes" in html
    assert "Stop</button>" not in html  # viewers look only


def test_a_waiting_group_says_why_including_parts_the_page_does_not_know(client, world):
    make_node("n0", gpus=2)
    group = make_group(world.tenants["acme"], workers=4, gpus=2, name="big")
    run_cycle()
    member = signed_in(client, world.users["acme-member"])
    html = page(member, f"/portal/training/{group.pk}/")
    assert 'data-waiting="InsufficientResources"' in html
    assert "not enough nodes of type nvidia in the tenant&#x27;s reach: 1 of 4 workers" in html
    assert "1 of 4 workers could be placed now." in html
    # what the scheduler adds to the reason that the page does not know is shown as it is
    reason = TaskGroup.objects.get(pk=group.pk).schedule_reason
    TaskGroup.objects.filter(pk=group.pk).update(schedule_reason=reason | {"backfill_hint": "later"})
    html = page(member, f"/portal/training/{group.pk}/")
    assert "<dt>Backfill hint</dt>" in html and "later" in html


def test_the_reservation_against_starvation_is_laid_out(client, world, settings):
    settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS = 0  # the head reserves at once
    acme = world.tenants["acme"]
    n0 = make_node("n0", gpus=2)
    make_node("n1", gpus=2)
    make_task_holding(n0, acme, "running", card=0)
    group = make_group(acme, workers=2, gpus=2, name="big")
    run_cycle()
    run_cycle()
    member = signed_in(client, world.users["acme-member"])
    html = page(member, f"/portal/training/{group.pk}/")
    assert 'data-reservation="holding"' in html
    assert "Reserved against starvation: 1 of 2 nodes held." in html
    assert '<td><code>n1</code></td><td class="num">2</td><td class="num">2</td>' in html
    assert '<td><code>n0</code></td><td class="num">1</td><td class="num">2</td>' in html
    assert "<dt>Reservation</dt>" not in html  # laid out, not dumped


def test_stop_is_a_post_with_the_csrf_token_and_goes_through_the_service(world):
    group = make_group(world.tenants["acme"], workers=2, gpus=1, name="llm")
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(world.users["acme-member"])
    html = page(browser, f"/portal/training/{group.pk}/")
    assert "Stop</button>" in html
    assert browser.get(f"/portal/training/{group.pk}/stop/").status_code == 405
    assert browser.post(f"/portal/training/{group.pk}/stop/").status_code == 403  # no token
    assert {t.status for t in group.tasks.all()} == {"pending"}
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html).group(1)
    response = browser.post(f"/portal/training/{group.pk}/stop/", {"csrfmiddlewaretoken": token}, follow=True)
    assert response.status_code == 200
    html = response.content.decode()
    assert f"Training group #{group.pk} is stopped." in html and "Stop</button>" not in html
    assert {t.status for t in group.tasks.all()} == {"cancelled"}
    again = browser.post(f"/portal/training/{group.pk}/stop/", {"csrfmiddlewaretoken": token}, follow=True)
    assert "is stopped and cannot be stopped now" in again.content.decode()


def test_viewers_cannot_stop(client, world):
    group = make_group(world.tenants["acme"], workers=2, gpus=1)
    assert signed_in(client, world.users["acme-viewer"]).post(f"/portal/training/{group.pk}/stop/").status_code == 403
    assert {t.status for t in group.tasks.all()} == {"pending"}
