"""The live log panel of the task and training group pages (apps/portal/pages/logs.py,
templates/portal/_log_panel.html) with Django's test client: what the page gives its
script, scoped like the rest of the portal; an ended task with only its final log tail;
and the session's tenant being the one the log API acts for, which is what lets the
panel's EventSource (which sends no header) follow a task of the tenant chosen in the
switcher. The panel in a browser: tests/portal/browser/test_task_logs_browser.py."""

import json
import re

import pytest
from django.utils.html import escape

from apps.tasks.models import Task
from apps.tenants.services import add_member
from tests.factories import make_group, make_node, make_task
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db


def panel_data(html: str) -> dict:
    found = re.search(r'<script id="log-panel-data" type="application/json">(.*?)</script>', html, re.S)
    assert found, "no log panel data on the page"
    return json.loads(found.group(1))


def test_another_tenants_task_and_group_are_404_and_their_logs_too(client, world):
    beta = world.tenants["beta"]
    task = make_task(beta, status="completed", exit_code=0, log_tail="beta's secret output\n")
    group = make_group(beta, 2, 1)
    member = signed_in(client, world.users["acme-member"])
    assert "beta's secret output" not in page(member, f"/portal/tasks/{task.pk}/", 404)
    page(member, f"/portal/training/{group.pk}/", 404)
    # what the panel would read with the same session
    assert member.get(f"/api/v1/tasks/{task.pk}/logs?tail=10").status_code == 404
    assert member.get(f"/api/v1/task-groups/{group.pk}/logs?tail=10").status_code == 404
    owner = signed_in(client, world.users["beta-viewer"])
    assert "beta&#x27;s secret output" in page(owner, f"/portal/tasks/{task.pk}/")


def test_an_ended_task_with_only_its_log_tail_renders_the_tail_and_no_follow(client, world):
    task = make_task(world.tenants["acme"], status="completed", exit_code=3, log_tail="epoch 9 done\n<bye>\n")
    html = page(signed_in(client, world.users["acme-viewer"]), f"/portal/tasks/{task.pk}/")
    assert "Ended: completed, exit code 3" in html
    assert "<pre data-log>epoch 9 done\n&lt;bye&gt;\n</pre>" in html
    data = panel_data(html)
    assert data["kind"] == "task" and data["ended"] is True and data["exit_code"] == 3
    assert data["url"] == f"/api/v1/tasks/{task.pk}/logs"
    assert data["tails"] == {"": "epoch 9 done\n<bye>\n"}
    assert (data["tail"], data["bound"]) == (1000, 5000)
    assert re.search(r'<script src="/static/portal/logs\.js[^"]*"></script>', html)
    # the controls wait for the script; without it the tail is what shows
    assert re.search(r'<div class="log-controls" data-log-controls hidden>', html)


def test_a_running_task_without_output_yet_is_followed(client, world):
    node = make_node("logs-node-1", 2)
    task = make_task(world.tenants["acme"], status="running", node=node)
    html = page(signed_in(client, world.users["acme-member"]), f"/portal/tasks/{task.pk}/")
    data = panel_data(html)
    assert data["ended"] is False and data["status"] == "running" and data["tails"] == {}
    assert "completed" in data["terminal"] and "running" not in data["terminal"]
    assert "No output yet." in html and 'data-log-status role="status">Running<' in html


def test_the_group_page_gives_every_rank_and_each_members_log(client, world):
    group = make_group(world.tenants["acme"], 2, 1, name="llm")
    first, second = Task.objects.filter(group=group).order_by("rank")
    Task.objects.filter(pk=second.pk).update(status="failed", exit_code=1, log_tail="rank 1 oom\n")
    Task.objects.filter(pk=first.pk).update(status="completed", exit_code=0)
    html = page(signed_in(client, world.users["acme-member"]), f"/portal/training/{group.pk}/")
    data = panel_data(html)
    assert data["kind"] == "group" and data["url"] == f"/api/v1/task-groups/{group.pk}/logs"
    assert data["ranks"] == [0, 1] and data["ended"] is True
    assert data["exit_codes"] == {"0": 0, "1": 1}
    assert data["members"] == {"0": f"/api/v1/tasks/{first.pk}/logs", "1": f"/api/v1/tasks/{second.pk}/logs"}
    assert data["tails"] == {"1": "rank 1 oom\n"}
    assert '<option value="">All ranks</option>' in html and '<option value="1">Rank 1</option>' in html
    assert '<div data-log-tail-rank="1"><h3>Rank 1: last lines</h3><pre data-log>rank 1 oom\n</pre></div>' in html


def test_a_group_still_running_is_followed(client, world):
    group = make_group(world.tenants["acme"], 2, 1)
    Task.objects.filter(group=group, rank=0).update(status="completed", exit_code=0)
    data = panel_data(page(signed_in(client, world.users["acme-member"]), f"/portal/training/{group.pk}/"))
    assert data["ended"] is False  # rank 1 is still pending: the group's log goes on


def test_the_log_api_acts_for_the_tenant_the_switcher_chose_with_no_header(client, world):
    """The panel's EventSource can send no X-HeteroFlow-Tenant header: the session's
    tenant (the switcher's choice) is what the API's session authentication acts for."""
    user = world.users["acme-member"]
    add_member(world.tenants["beta"], username=user.username, role="viewer")
    acme = make_task(world.tenants["acme"], status="completed", exit_code=0, log_tail="acme out\n")
    beta = make_task(world.tenants["beta"], status="completed", exit_code=0, log_tail="beta out\n")
    member = signed_in(client, user)
    assert member.get(f"/api/v1/tasks/{acme.pk}/logs?tail=1").json()["log_tail"] == "acme out\n"
    assert member.get(f"/api/v1/tasks/{beta.pk}/logs?tail=1").status_code == 404
    member.post("/portal/tenant/", {"tenant": "beta"})
    assert escape("beta out") in page(member, f"/portal/tasks/{beta.pk}/")
    assert member.get(f"/api/v1/tasks/{beta.pk}/logs?tail=1").json()["log_tail"] == "beta out\n"
    assert member.get(f"/api/v1/tasks/{acme.pk}/logs?tail=1").status_code == 404
    page(member, f"/portal/tasks/{acme.pk}/", 404)
