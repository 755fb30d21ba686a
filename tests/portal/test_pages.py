"""Portal pages with Django's test client: who may see and do what. Every page scopes as
the API does: another tenant's node, task or alert is 404; operator-only parts are hidden
and refused for the others."""

import re

import pytest

from apps.alerts.models import Alert
from apps.nodes.models import Node
from apps.scheduler.services import run_cycle
from apps.tasks import services as task_services
from apps.tasks.models import Task
from apps.tenants.models import ApiKey, Membership
from tests.headers import bearer, tenant_header
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db

PAGES = [
    "/portal/",
    "/portal/nodes/",
    "/portal/nodes/monitor/",
    "/portal/environment/",
    "/portal/tasks/",
    "/portal/tasks/new/",
    "/portal/alerts/",
    "/portal/keys/",
    "/portal/members/",
    "/portal/nodes/shared-1/",
    "/portal/tasks/1/",
    "/portal/alerts/1/",
]


def status_bar(html):
    return {name: int(value) for name, value in re.findall(r'data-status="([a-z-]+)">(\d+)<', html)}


@pytest.mark.parametrize("url", PAGES)
def test_an_anonymous_visitor_is_sent_to_the_sign_in_page(client, url):
    response = client.get(url)
    assert response.status_code == 302 and response["Location"].startswith("/portal/login/?next=")


def test_signing_in_with_the_form_lands_on_the_dashboard(client, world):
    response = client.post(
        "/portal/login/", {"username": "acme-member", "password": "pw-for-tests-only", "next": "/portal/nodes/"}
    )
    assert response.status_code == 302 and response["Location"] == "/portal/nodes/"
    assert "Nodes" in page(client, "/portal/nodes/")
    client.logout()
    bad = client.post("/portal/login/", {"username": "acme-member", "password": "wrong"})
    assert "did not match" in bad.content.decode()


def test_the_status_bar_is_narrowed_to_what_the_user_may_see(client, world, cluster):
    shared = cluster.nodes["shared"]
    task = task_services.create_task(tenant=world.tenants["acme"], name="t", image="busybox", gpu_required=1)
    Task.objects.filter(pk=task.pk).update(status="running", node=shared)
    operator = status_bar(page(signed_in(client, world.operator), "/portal/"))
    # online nodes: shared-1 (3 cards not lost), shared-2 (2), beta-1 (2); shared-3 is offline
    assert operator == {"gpus-online": 7, "tasks-running": 1, "alerts-active": 3}
    acme = status_bar(page(signed_in(client, world.users["acme-viewer"]), "/portal/nodes/"))
    assert acme == {"gpus-online": 5, "tasks-running": 1, "alerts-active": 1}  # no beta node, no GPU alert
    beta = status_bar(page(signed_in(client, world.users["beta-member"]), "/portal/tasks/"))
    assert beta == {"gpus-online": 7, "tasks-running": 0, "alerts-active": 1}


def test_a_user_in_several_tenants_switches_between_them(client, world, cluster):
    from apps.tenants.services import add_member

    user = world.users["acme-member"]
    add_member(world.tenants["beta"], username=user.username, role="viewer")
    signed_in(client, user)
    html = page(client, "/portal/")
    assert 'id="tenant-switch"' in html and "Acting in tenant <strong>Acme</strong>" in html
    assert page(client, "/portal/nodes/beta-1/", 404)
    response = client.post("/portal/tenant/", {"tenant": "beta", "next": "/portal/nodes/"})
    assert response.status_code == 302 and response["Location"] == "/portal/nodes/"
    assert "Acting in tenant <strong>Beta</strong> as <strong>viewer</strong>" in page(client, "/portal/")
    assert "charlie" in page(client, "/portal/nodes/beta-1/")
    assert client.post("/portal/tenant/", {"tenant": "gamma"}).status_code == 404
    assert client.post("/portal/tenant/", {"tenant": "beta", "next": "https://evil.example/"})["Location"] == "/portal/"


# --- nodes ----------------------------------------------------------------------------------------


def test_nodes_page_summary_search_sorts_and_scope(client, world, cluster):
    task = task_services.create_task(tenant=world.tenants["acme"], name="t", image="busybox", gpu_required=2)
    assert run_cycle().bound == [task.pk]
    task.refresh_from_db()
    signed_in(client, world.operator)
    html = page(client, "/portal/nodes/")
    strip = dict(re.findall(r'data-summary="([a-z-]+)">([^<]+)<', html))
    assert strip == {"total": "9", "busy": "2", "idle": "6", "lost": "1", "success-rate": "100.0%"}
    names = lambda html: re.findall(r'<h2>([a-z]+)</h2><span class="badge', html)  # noqa: E731
    assert names(html)[0] == Node.objects.get(pk=task.node_id).name  # default order: most tasks first
    assert names(page(client, "/portal/nodes/?sort=name")) == ["alpha", "bravo", "charlie", "delta"]
    assert names(page(client, "/portal/nodes/?sort=busy"))[0] == Node.objects.get(pk=task.node_id).name
    assert names(page(client, "/portal/nodes/?q=r12")) == ["alpha"]  # rack
    assert names(page(client, "/portal/nodes/?q=nomatch")) == [] and "No node matches" in page(
        client, "/portal/nodes/?q=nomatch"
    )
    member = signed_in(client, world.users["acme-member"])
    assert "charlie" not in page(member, "/portal/nodes/")
    page(member, "/portal/nodes/beta-1/", 404)
    page(member, "/portal/nodes/monitor/?node=beta-1", 404)
    page(member, "/portal/nodes/no-such-node/", 404)


def test_the_utilisation_order_puts_unknown_readings_last(client, world, cluster):
    from apps.nodes.models import Gpu

    Gpu.objects.filter(node_id="shared-2").update(utilization=90.0)
    Gpu.objects.filter(node_id="shared-3").update(utilization=None)
    html = page(signed_in(client, world.operator), "/portal/nodes/?sort=utilization")
    assert re.findall(r'<h2>([a-z]+)</h2><span class="badge', html) == ["bravo", "alpha", "charlie", "delta"]


def test_node_detail_shows_cards_labels_models_and_lost_cards(client, world, cluster):
    from apps.nodes.services import upsert_node

    upsert_node(
        "shared-1",
        {
            "labels": {"heteroflow.cache/models": "Qwen3-8B, Llama-3-70B"},
            "discovered_models": [
                {
                    "name": "Qwen3-32B",
                    "path": "/models/Qwen3-32B",
                    "size_bytes": 65_000_000_000,
                    "format": "safetensors",
                }
            ],
        },
    )
    html = page(signed_in(client, world.users["acme-viewer"]), "/portal/nodes/shared-1/")
    assert html.count('<tr data-gpu="') == 4
    lost_row = html.split('data-gpu="3"')[1].split("</tr>")[0]
    assert ">lost</span>" in lost_row and "Heartbeat Absent" in lost_row
    assert "Qwen3-32B" in html and "Llama-3-70B" in html and "Qwen3-8B" in html and "heteroflow.cache/models" in html
    assert 'id="location-form"' not in html and "Delete node" not in html  # operators' tools are hidden


def test_a_lost_card_known_only_by_its_position_says_which_one_cannot_be_told(client, world, cluster):
    from apps.nodes.choices import CardIdentity
    from apps.nodes.models import Gpu

    Gpu.objects.filter(node_id="shared-1", index=1).update(
        pci_bus_id="0000:3f:00.0", matched_by=CardIdentity.PCI_BUS_ID
    )
    viewer = signed_in(client, world.users["acme-viewer"])
    html = page(viewer, "/portal/nodes/shared-1/")
    assert "PCI <code>0000:3f:00.0</code>" in html.split('data-gpu="1"')[1].split("</tr>")[0]
    assert "data-unidentified" not in html  # the lost card 3 is known by its index
    Gpu.objects.filter(node_id="shared-1", index=3).update(matched_by=CardIdentity.POSITION)
    lost_row = page(viewer, "/portal/nodes/shared-1/").split('data-gpu="3"')[1].split("</tr>")[0]
    assert "data-unidentified" in lost_row and "cannot be told" in lost_row


def test_location_and_tenant_are_for_operators(client, world, cluster):
    member = signed_in(client, world.users["acme-admin"])
    assert member.post("/portal/nodes/shared-1/location/", {"region": "x", "zone": "", "rack": ""}).status_code == 403
    assert member.post("/portal/nodes/shared-1/tenant/", {"tenant": "acme", "version": 1}).status_code == 403
    operator = signed_in(client, world.operator)
    assert 'id="location-form"' in page(operator, "/portal/nodes/shared-1/")
    operator.post("/portal/nodes/shared-1/location/", {"region": "eu-west", "zone": "", "rack": "r7"})
    node = Node.objects.get(pk="shared-1")
    assert (node.region, node.zone, node.rack) == ("eu-west", "", "r7")  # an empty field clears
    html = client.post("/portal/nodes/shared-1/location/", {"region": "x" * 65}, follow=True).content.decode()
    assert "region: Ensure this field has no more than 64 characters." in html
    stale = client.post("/portal/nodes/shared-1/tenant/", {"tenant": "acme", "version": node.version + 5}, follow=True)
    assert "The node was changed by someone else" in stale.content.decode()
    unknown = client.post("/portal/nodes/shared-1/tenant/", {"tenant": "gamma", "version": node.version}, follow=True)
    assert "No tenant &#x27;gamma&#x27;." in unknown.content.decode()


def test_assigning_a_tenant_drains_first_then_offers_to_stop_the_others(client, world, cluster):
    beta_task = task_services.create_task(tenant=world.tenants["beta"], name="b", image="busybox", gpu_required=1)
    Task.objects.filter(pk=beta_task.pk).update(status="running", node_id="shared-2")
    operator = signed_in(client, world.operator)
    version = Node.objects.get(pk="shared-2").version
    response = operator.post("/portal/nodes/shared-2/tenant/", {"tenant": "acme", "version": version})
    assert response["Location"] == f"/portal/nodes/shared-2/?others={beta_task.pk}"
    html = page(operator, response["Location"])
    assert f"Other tenants still run tasks here: #{beta_task.pk}" in html and "Stop them now" in html
    assert Task.objects.get(pk=beta_task.pk).status == "running"  # drain: left to finish
    operator.post("/portal/nodes/shared-2/tenant/", {"tenant": "acme", "version": version + 1, "mode": "evict"})
    assert Task.objects.get(pk=beta_task.pk).status == "stopping"
    assert Node.objects.get(pk="shared-2").tenant == world.tenants["acme"]


def test_deleting_a_node_shows_the_apis_409_reason_and_checks_who_may(client, world, cluster):
    task = task_services.create_task(tenant=world.tenants["acme"], name="t", image="busybox", gpu_required=1)
    Task.objects.filter(pk=task.pk).update(status="running", node_id="shared-2")
    api_answer = client.delete("/api/v1/nodes/shared-2", **bearer(world.operator_key)).json()["error"]["message"]
    operator = signed_in(client, world.operator)
    html = operator.post("/portal/nodes/shared-2/delete/", follow=True).content.decode()
    assert api_answer.replace("'", "&#x27;") in html and f"#{task.pk} (running)" in html
    assert Node.objects.filter(pk="shared-2").exists()
    beta_admin = signed_in(client, world.users["beta-admin"])
    assert beta_admin.post("/portal/nodes/shared-3/delete/").status_code == 403  # shared: operators only
    assert beta_admin.post("/portal/nodes/beta-1/delete/").status_code == 302  # its own dedicated node
    assert not Node.objects.filter(pk="beta-1").exists()
    assert signed_in(client, world.users["acme-admin"]).post("/portal/nodes/beta-1/delete/").status_code == 404


def test_the_monitor_renders_history_energy_and_unsupported_metrics(client, world, cluster):
    from datetime import timedelta

    from django.db import connection

    from apps.core.clock import utcnow
    from apps.nodes.models import Gpu

    now = utcnow()
    with connection.cursor() as cursor:
        for i in range(24):
            cursor.execute(
                "INSERT INTO node_metrics (node_id, at, cpu_used, memory_used, gpus) "
                "VALUES (%s, %s, %s, %s, %s::jsonb)",
                ["shared-2", now - timedelta(seconds=5 * i), 30.0, 45.0, '[{"i": 0, "u": 50, "m": 2048, "p": 300}]'],
            )
    Gpu.objects.filter(node_id="shared-2").update(
        metrics_available=["utilization", "memory_used_mb", "power_w"], temperature=None
    )
    html = page(signed_in(client, world.users["acme-member"]), "/portal/nodes/monitor/?node=shared-2&hours=6")
    assert 'data-range="6" aria-current="true"' in html
    assert '<div class="value none" data-live="temperature">not supported</div>' in html
    assert 'data-energy="kwh">—' not in html and 'data-energy="avg">300 W</span>' in html
    data = re.search(r'<script id="monitor-data" type="application/json">(.*?)</script>', html, re.S).group(1)
    import json

    data = json.loads(data)
    assert data["hours"] == 6 and data["supported"]["temperature"] is False and len(data["history"]["points"]) >= 2
    assert (
        data["metrics_url"] == "/api/v1/nodes/metrics/shared-2"
        and data["energy_url"] == "/api/v1/nodes/shared-2/energy"
    )
    empty = page(client, "/portal/nodes/monitor/?node=shared-1&hours=168&gpu=2")
    assert 'data-energy="kwh">—</div>' in empty and 'data-range="168" aria-current="true"' in empty
    assert '<option value="2" selected>' in empty
    # a range the page does not offer falls back to 1 h
    assert 'data-range="1" aria-current="true"' in page(client, "/portal/nodes/monitor/?node=shared-1&hours=5")


def test_environment_tabs_and_scope(client, world, cluster):
    operator = signed_in(client, world.operator)
    alive = page(operator, "/portal/environment/")
    assert re.findall(r'<tr data-node="([^"]+)"', alive) == ["shared-1", "shared-2", "beta-1"]
    assert re.findall(r'<tr data-node="([^"]+)"', page(operator, "/portal/environment/?tab=offline")) == ["shared-3"]
    assert len(re.findall(r'<tr data-node="', page(operator, "/portal/environment/?tab=all"))) == 4
    assert 'data-summary="gpus-lost">1<' in alive
    member = page(signed_in(client, world.users["acme-member"]), "/portal/environment/?tab=all")
    assert "beta-1" not in member and 'data-summary="nodes">3<' in member


# --- tasks ----------------------------------------------------------------------------------------


def test_the_task_form_says_what_the_api_says(client, world, cluster, api):
    bad = {
        "name": "",
        "image": "busybox",
        "gpu_required": 65,
        "priority": 101,
        "kind": "training",
        "preemptible": True,
        "env": {"1BAD": "x"},
    }
    api_fields = api.post("/api/v1/tasks", bad, format="json", **bearer(world.keys["acme-member"])).json()["error"][
        "fields"
    ]
    member = signed_in(client, world.users["acme-member"])
    response = member.post(
        "/portal/tasks/new/",
        {
            "name": "",
            "image": "busybox",
            "gpu_required": "65",
            "priority": "101",
            "kind": "training",
            "preemptible": "on",
            "env": "1BAD=x",
        },
    )
    assert response.status_code == 400
    html = response.content.decode()
    for field, messages in api_fields.items():
        for message in messages:
            assert f'data-errors="{field}"' in html and message.replace("'", "&#x27;") in html, (field, message)
    assert not Task.objects.exists()


def test_training_cannot_be_preemptible_and_quota_is_refused_like_the_api(client, world, cluster):
    member = signed_in(client, world.users["acme-member"])
    html = member.post(
        "/portal/tasks/new/", {"name": "t", "image": "busybox", "kind": "training", "preemptible": "on"}
    ).content.decode()
    assert "Training tasks cannot be preemptible." in html
    from apps.tenants.models import Tenant
    from apps.tenants.services import update_tenant

    update_tenant(Tenant.objects.get(slug="acme"), max_gpus=1)  # a copy: the world's object outlives this test
    html = member.post("/portal/tasks/new/", {"name": "t", "image": "busybox", "gpu_required": "2"}).content.decode()
    assert "Quota of tenant &#x27;acme&#x27; exceeded: 0 of 1 GPUs in use, 2 more asked." in html


def test_submitting_a_task_queues_it_and_the_scheduler_places_it(client, world, cluster):
    member = signed_in(client, world.users["acme-member"])
    response = member.post(
        "/portal/tasks/new/",
        {
            "name": "train-llm",
            "image": "busybox",
            "command": "sh\n-c\necho hi",
            "gpu_required": "2",
            "env": 'MODEL=qwen\nTOKEN={"secret": "missing"}',
            "labels": "zone=az1",
        },
    )
    assert (
        response.status_code == 400
        and "No secret named &#x27;missing&#x27; in tenant &#x27;acme&#x27;." in response.content.decode()
    )
    response = member.post(
        "/portal/tasks/new/",
        {
            "name": "train-llm",
            "image": "busybox",
            "command": "sh\n-c\necho hi",
            "gpu_required": "2",
            "env": "MODEL=qwen",
            "labels": "zone=az1",
        },
    )
    task = Task.objects.get(name="train-llm")
    assert response["Location"] == f"/portal/tasks/{task.pk}/"
    assert (task.command, task.env, task.labels, task.created_by) == (
        ["sh", "-c", "echo hi"],
        {"MODEL": "qwen"},
        {"zone": "az1"},
        world.users["acme-member"],
    )
    assert 'data-explanation="waiting"' in page(member, response["Location"])
    assert run_cycle().bound == [task.pk]
    html = page(member, response["Location"])
    assert ">scheduled</span>" in html and 'data-explanation="placed"' in html and "GPU 0, 1" in html


def test_an_unplaceable_task_explains_why(client, world, cluster):
    task = task_services.create_task(tenant=world.tenants["acme"], name="huge", image="busybox", gpu_required=8)
    run_cycle()
    html = page(signed_in(client, world.users["acme-viewer"]), f"/portal/tasks/{task.pk}/")
    assert 'data-explanation="InsufficientResources"' in html and "not enough free GPUs or GPU memory" in html


def test_task_pages_scope_filters_and_who_may_stop(client, world, cluster):
    acme = task_services.create_task(tenant=world.tenants["acme"], name="acme-job", image="busybox", gpu_required=1)
    beta = task_services.create_task(tenant=world.tenants["beta"], name="beta-job", image="busybox", gpu_required=1)
    viewer = signed_in(client, world.users["acme-viewer"])
    assert "acme-job" in page(viewer, "/portal/tasks/") and "beta-job" not in page(viewer, "/portal/tasks/")
    page(viewer, f"/portal/tasks/{beta.pk}/", 404)
    assert viewer.post(f"/portal/tasks/{beta.pk}/stop/").status_code == 404
    assert "Cancel</button>" not in page(viewer, f"/portal/tasks/{acme.pk}/")
    assert viewer.post(f"/portal/tasks/{acme.pk}/stop/").status_code == 403
    page(viewer, "/portal/tasks/new/", 403)
    operator = signed_in(client, world.operator)
    assert re.findall(r'<tr data-task="(\d+)"', page(operator, "/portal/tasks/?tenant=beta")) == [str(beta.pk)]
    assert re.findall(r'<tr data-task="(\d+)"', page(operator, "/portal/tasks/?status=running")) == []
    assert re.findall(r'<tr data-task="(\d+)"', page(operator, "/portal/tasks/?q=acme")) == [str(acme.pk)]
    member = signed_in(client, world.users["acme-member"])
    assert "Cancel</button>" in page(member, f"/portal/tasks/{acme.pk}/")
    member.post(f"/portal/tasks/{acme.pk}/stop/")
    assert Task.objects.get(pk=acme.pk).status == "cancelled"


def test_operators_submit_for_a_tenant_they_name(client, world, cluster):
    operator = signed_in(client, world.operator)
    html = operator.post("/portal/tasks/new/", {"name": "x", "image": "busybox"}).content.decode()
    assert "Required: the slug of the tenant the task runs for." in html
    response = operator.post("/portal/tasks/new/", {"tenant": "beta", "name": "x", "image": "busybox"})
    assert response.status_code == 302 and Task.objects.get(name="x").tenant == world.tenants["beta"]


def test_a_task_shows_its_history_and_log_tail(client, world, cluster):
    task = task_services.create_task(tenant=world.tenants["acme"], name="t", image="busybox", gpu_required=1)
    run_cycle()
    task.refresh_from_db()
    task_services.record_event(task, kind="checkpoint_resume", message="resumed from step 400", node_id=task.node_id)
    task_services.agent_report(task, from_status="scheduled", to_status="running")
    task_services.agent_report(
        task, from_status="running", to_status="completed", exit_code=0, log_tail="epoch 3 done\nbye\n"
    )
    html = page(signed_in(client, world.users["acme-member"]), f"/portal/tasks/{task.pk}/")
    assert "resumed from step 400" in html and "Ended as completed." in html and "epoch 3 done\nbye" in html


# --- alerts ---------------------------------------------------------------------------------------


def test_alerts_are_scoped_and_filtered(client, world, cluster):
    gpu_alert, acme_alert, beta_alert = (cluster.alerts[k] for k in ("GPU_LOST:shared-1:3", "quota:acme", "quota:beta"))
    member = signed_in(client, world.users["acme-member"])
    listed = re.findall(r'<tr data-alert="(\d+)"', page(member, "/portal/alerts/"))
    assert listed == [str(acme_alert.pk)]
    page(member, f"/portal/alerts/{beta_alert.pk}/", 404)
    page(member, f"/portal/alerts/{gpu_alert.pk}/", 404)  # node and GPU alerts are for operators
    operator = signed_in(client, world.operator)
    assert len(re.findall(r'<tr data-alert="', page(operator, "/portal/alerts/"))) == 3
    assert re.findall(r'<tr data-alert="(\d+)"', page(operator, "/portal/alerts/?scope=gpu")) == [str(gpu_alert.pk)]
    assert re.findall(r'<tr data-alert="(\d+)"', page(operator, "/portal/alerts/?severity=error")) == [
        str(gpu_alert.pk)
    ]
    assert re.findall(r'<tr data-alert="', page(operator, "/portal/alerts/?state=RESOLVED")) == []


def test_anyone_who_sees_an_alert_acknowledges_it_only_admins_resolve(client, world, cluster):
    alert = cluster.alerts["quota:acme"]
    viewer = signed_in(client, world.users["acme-viewer"])
    html = page(viewer, f"/portal/alerts/{alert.pk}/")
    assert "Acknowledge</button>" in html and "Resolve</button>" not in html
    viewer.post(f"/portal/alerts/{alert.pk}/acknowledge/")
    alert.refresh_from_db()
    assert alert.acknowledged_by == world.users["acme-viewer"]
    assert viewer.post(f"/portal/alerts/{alert.pk}/resolve/").status_code == 403
    assert signed_in(client, world.users["beta-admin"]).post(f"/portal/alerts/{alert.pk}/resolve/").status_code == 404
    admin = signed_in(client, world.users["acme-admin"])
    admin.post(f"/portal/alerts/{alert.pk}/resolve/")
    alert.refresh_from_db()
    assert alert.state == "RESOLVED" and alert.resolved_by == world.users["acme-admin"]
    gpu_alert = cluster.alerts["GPU_LOST:shared-1:3"]
    signed_in(client, world.operator).post(f"/portal/alerts/{gpu_alert.pk}/resolve/")
    assert Alert.objects.get(pk=gpu_alert.pk).state == "RESOLVED"


# --- keys and members -----------------------------------------------------------------------------


def test_a_new_key_is_shown_once_and_works_and_can_be_revoked(client, world, api):
    member = signed_in(client, world.users["acme-member"])
    response = member.post("/portal/keys/", {"name": "laptop", "role": "viewer"})
    assert response["Cache-Control"] == "no-store"
    key = re.search(r"data-new-key>(sk-tenant-[^<]+)<", response.content.decode()).group(1)
    assert api.get("/api/v1/tasks", **bearer(key)).status_code == 200
    assert key not in page(member, "/portal/keys/")  # once
    stored = ApiKey.objects.get(name="laptop")
    assert stored.role == "viewer" and stored.user == world.users["acme-member"]
    html = member.post("/portal/keys/", {"name": "strong", "role": "admin"}).content.decode()
    assert "A key issued here can be at most member, not admin." in html
    other = ApiKey.objects.get(name="acme-admin")
    assert member.post(f"/portal/keys/{other.pk}/revoke/").status_code == 404  # members see only their own keys
    member.post(f"/portal/keys/{stored.pk}/revoke/")
    assert api.get("/api/v1/tasks", **bearer(key)).status_code == 401
    beta = ApiKey.objects.get(name="beta-member")
    assert signed_in(client, world.users["acme-admin"]).post(f"/portal/keys/{beta.pk}/revoke/").status_code == 404


def test_operators_issue_platform_keys(client, world):
    html = signed_in(client, world.operator).post("/portal/keys/", {"name": "ops-laptop"}).content.decode()
    assert re.search(r"data-new-key>sk-admin-", html)


def test_members_page_is_for_tenant_admins(client, world):
    page(signed_in(client, world.users["acme-member"]), "/portal/members/", 403)
    assert "/portal/members/" not in page(client, "/portal/")  # not in the member's menu
    admin = signed_in(client, world.users["acme-admin"])
    html = page(admin, "/portal/members/")
    assert re.findall(r'<tr data-member="([^"]+)"', html) == ["acme-admin", "acme-member", "acme-viewer"]
    response = admin.post("/portal/members/", {"username": "newbie", "role": "viewer"})
    assert "A new account was created" in response.content.decode()
    assert Membership.objects.get(user__username="newbie").tenant == world.tenants["acme"]
    assert "already a member" in admin.post("/portal/members/", {"username": "newbie"}).content.decode()
    last_admin = Membership.objects.get(user__username="acme-admin")
    html = admin.post(
        f"/portal/members/{last_admin.pk}/", {"action": "role", "role": "member"}, follow=True
    ).content.decode()
    assert "the last admin of &#x27;acme&#x27;" in html
    beta_member = Membership.objects.get(user__username="beta-member")
    assert admin.post(f"/portal/members/{beta_member.pk}/", {"action": "remove"}).status_code == 404
    viewer = Membership.objects.get(user__username="acme-viewer")
    admin.post(f"/portal/members/{viewer.pk}/", {"action": "remove"})
    assert not Membership.objects.filter(pk=viewer.pk).exists()
    assert not ApiKey.objects.filter(user__username="acme-viewer", revoked_at__isnull=True).exists()


def test_operators_manage_members_of_any_tenant(client, world):
    operator = signed_in(client, world.operator)
    assert "beta-viewer" in page(operator, "/portal/members/?tenant=beta")
    operator.post("/portal/members/", {"tenant": "beta", "username": "acme-member", "role": "member"})
    assert Membership.objects.filter(user__username="acme-member", tenant__slug="beta").exists()


def test_a_user_of_no_tenant_sees_nothing_and_a_foreign_tenant_header_is_refused(client, world, cluster):
    from tests.factories import UserFactory

    loner = signed_in(client, UserFactory(username="loner"))
    html = page(loner, "/portal/")
    assert "not a member of any tenant" in html and status_bar(html) == {
        "gpus-online": 0,
        "tasks-running": 0,
        "alerts-active": 0,
    }
    assert "alpha" not in page(loner, "/portal/nodes/")
    page(loner, "/portal/tasks/new/", 403)
    page(loner, "/portal/keys/", 403)
    member = signed_in(client, world.users["acme-member"])
    assert member.get("/portal/", **tenant_header("beta")).status_code == 403
