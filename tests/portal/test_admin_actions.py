"""The operators' admin acts through the same services as the API: nodes (location,
owner, drain, maintenance, delete with its checks), GPUs (lost cards), tasks (cancel,
requeue, filters), scheduler plugins (exclusive layouts, locked filters), tenant groups."""

import pytest

from apps.nodes.models import Gpu, Node
from apps.scheduler.core import CORDON_LABEL
from apps.scheduler.models import PluginConfig
from apps.scheduler.services import plugin_table, run_cycle
from apps.tasks import services as task_services
from apps.tasks.models import Task
from apps.tenants.models import TenantGroup

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(client, world):
    client.force_login(world.operator)
    return client


def action(admin, model_url, name, *pks):
    response = admin.post(model_url, {"action": name, "_selected_action": [str(pk) for pk in pks]}, follow=True)
    assert response.status_code == 200
    return response.content.decode()


def test_the_admin_is_for_staff_only(client, world):
    client.force_login(world.users["acme-admin"])
    assert client.get("/admin/nodes/node/").status_code == 302  # to the admin's sign-in


def test_node_pages_show_lost_cards_and_the_service_state(admin, world, cluster):
    html = admin.get("/admin/nodes/node/shared-1/change/").content.decode()
    assert "LOST since" in html and "Heartbeat Absent" in html and "in service" in html
    listing = admin.get("/admin/nodes/node/?status__exact=offline").content.decode()
    assert "delta" in listing and "alpha" not in listing
    assert "LOST since" in admin.get("/admin/nodes/gpu/?lost=yes").content.decode()
    assert admin.get("/admin/nodes/node/add/").status_code == 403  # nodes register by heartbeat


def test_location_and_owner_are_changed_through_the_services(admin, world, cluster):
    node = Node.objects.get(pk="shared-2")
    Node.objects.filter(pk="shared-2").update(cpu_used=77.0)  # a heartbeat's column, changed meanwhile
    form = {
        "region": "eu",
        "zone": "az9",
        "rack": "",
        "tenant": "",
        "seen_version": node.version,
        "gpus-TOTAL_FORMS": "0",
        "gpus-INITIAL_FORMS": "0",
    }
    assert admin.post("/admin/nodes/node/shared-2/change/", form).status_code == 302
    node.refresh_from_db()
    assert (node.region, node.zone, node.cpu_used) == ("eu", "az9", 77.0)  # no whole-row save
    stale = admin.post(
        "/admin/nodes/node/shared-2/change/",
        form | {"tenant": world.tenants["acme"].pk, "seen_version": node.version - 1},
        follow=True,
    )
    assert "The owner was not changed: The node was changed by someone else" in stale.content.decode()
    assert Node.objects.get(pk="shared-2").tenant is None
    admin.post(
        "/admin/nodes/node/shared-2/change/", form | {"tenant": world.tenants["acme"].pk, "seen_version": node.version}
    )
    node.refresh_from_db()
    assert node.tenant == world.tenants["acme"] and node.version == 2


def test_drain_maintenance_and_back_in_service(admin, world, cluster):
    task = task_services.create_task(tenant=world.tenants["acme"], name="t", image="x", gpu_required=2)
    assert run_cycle().bound == [task.pk]
    task.refresh_from_db()
    node_id = task.node_id
    html = action(admin, "/admin/nodes/node/", "drain", node_id)
    assert "Draining 1 node(s)" in html
    assert Node.objects.get(pk=node_id).labels[CORDON_LABEL] == "drain"
    assert Task.objects.get(pk=task.pk).status == "scheduled"  # drain leaves it
    html = action(admin, "/admin/nodes/node/", "mark_maintenance", node_id)
    assert f"Requeued: #{task.pk}" in html
    assert Task.objects.get(pk=task.pk).status == "pending"
    assert Node.objects.get(pk=node_id).labels[CORDON_LABEL] == "maintenance"
    action(admin, "/admin/nodes/node/", "back_in_service", node_id)
    assert CORDON_LABEL not in Node.objects.get(pk=node_id).labels


def test_deleting_a_node_keeps_the_apis_checks(admin, world, cluster):
    task = task_services.create_task(tenant=world.tenants["acme"], name="t", image="x", gpu_required=1)
    Task.objects.filter(pk=task.pk).update(status="running", node_id="shared-2")
    html = admin.post("/admin/nodes/node/shared-2/delete/", {"post": "yes"}, follow=True).content.decode()
    assert f"has active tasks: #{task.pk} (running)" in html and Node.objects.filter(pk="shared-2").exists()
    html = action(admin, "/admin/nodes/node/", "delete_through_services", "shared-2", "shared-3")
    assert "has active tasks" in html and "Deleted delta." in html
    assert list(Node.objects.filter(pk__in=["shared-2", "shared-3"]).values_list("pk", flat=True)) == ["shared-2"]
    assert "delete_selected" not in admin.get("/admin/nodes/node/").content.decode()


def test_only_lost_cards_can_be_removed(admin, world, cluster):
    lost = Gpu.objects.get(node_id="shared-1", index=3)
    present = Gpu.objects.get(node_id="shared-1", index=0)
    html = action(admin, "/admin/nodes/gpu/", "forget_lost", lost.pk, present.pk)
    assert "Removed GPU 3 of alpha." in html and "GPU 0 of node &#x27;shared-1&#x27; is not lost" in html
    assert sorted(Gpu.objects.filter(node_id="shared-1").values_list("index", flat=True)) == [0, 1, 2]
    assert Node.objects.get(pk="shared-1").gpu_count == 3


def test_tasks_filter_cancel_and_requeue(admin, world, cluster):
    acme = task_services.create_task(tenant=world.tenants["acme"], name="acme-job", image="x", gpu_required=1)
    beta = task_services.create_task(tenant=world.tenants["beta"], name="beta-job", image="x", gpu_required=1)
    run_cycle()
    acme.refresh_from_db()
    listing = admin.get(f"/admin/tasks/task/?tenant__id__exact={world.tenants['beta'].pk}").content.decode()
    assert "beta-job" in listing and "acme-job" not in listing
    assert "acme-job" in admin.get(f"/admin/tasks/task/?node__id__exact={acme.node_id}").content.decode()
    assert "acme-job" not in admin.get("/admin/tasks/task/?status__exact=pending").content.decode()
    html = action(admin, "/admin/tasks/task/", "requeue", acme.pk)
    assert f"Task #{acme.pk} is pending." in html
    assert acme.events.get().message.startswith("requeued by op")
    html = action(admin, "/admin/tasks/task/", "cancel", beta.pk)
    assert Task.objects.get(pk=beta.pk).status == "cancelled"
    html = action(admin, "/admin/tasks/task/", "requeue", beta.pk)
    assert "is cancelled: only scheduled, starting and running tasks can be requeued" in html


def test_plugins_keep_the_apis_rules(admin):
    def enabled(name):
        return next(row["enabled"] for row in plugin_table() if row["name"] == name)

    page = admin.get("/admin/scheduler/pluginconfig/").content.decode()
    assert 'data-plugin="spread"' in page and 'data-plugin="gpu-filter"' in page
    admin.post("/admin/scheduler/pluginconfig/", {"plugin": "binpack", "action": "enable"})
    assert enabled("binpack") and not enabled("spread")  # the layouts are exclusive
    html = admin.post(
        "/admin/scheduler/pluginconfig/", {"plugin": "gpu-filter", "action": "disable"}, follow=True
    ).content.decode()
    assert "cannot be disabled or enabled" in html and enabled("gpu-filter")
    admin.post("/admin/scheduler/pluginconfig/", {"plugin": "topology", "action": "options", "weight": "2.5"})
    assert PluginConfig.objects.get(name="topology").weight == 2.5
    html = admin.post(
        "/admin/scheduler/pluginconfig/", {"plugin": "topology", "action": "options", "weight": "500"}, follow=True
    ).content.decode()
    assert "Ensure this value is less than or equal to 100." in html
    html = admin.post(
        "/admin/scheduler/pluginconfig/",
        {"plugin": "resource-filter", "action": "options", "extra": '{"cpu_percent_max": 150}'},
        follow=True,
    ).content.decode()
    assert "Must be a number from 0 to 100." in html


def test_tenant_groups_are_saved_through_the_service(admin, world):
    response = admin.post(
        "/admin/tenants/tenantgroup/add/",
        {"name": "shared-pool", "description": "", "tenants": [world.tenants["acme"].pk, world.tenants["beta"].pk]},
    )
    assert response.status_code == 302
    group = TenantGroup.objects.get(name="shared-pool")
    assert sorted(group.tenants.values_list("slug", flat=True)) == ["acme", "beta"]
    admin.post(
        f"/admin/tenants/tenantgroup/{group.pk}/change/",
        {"name": "shared-pool", "description": "x", "tenants": [world.tenants["acme"].pk]},
    )
    assert list(group.tenants.values_list("slug", flat=True)) == ["acme"]


def test_tasks_and_gpus_cannot_be_saved_whole_in_the_admin(admin, world, cluster):
    task = task_services.create_task(tenant=world.tenants["acme"], name="t", image="x", gpu_required=1)
    html = admin.get(f"/admin/tasks/task/{task.pk}/change/").content.decode()
    assert "t (pending)" in html and 'name="_save"' not in html  # a view, not a form
    assert admin.post(f"/admin/tasks/task/{task.pk}/change/", {"status": "completed"}).status_code == 403
    assert Task.objects.get(pk=task.pk).status == "pending"
    gpu = Gpu.objects.get(node_id="shared-1", index=0)
    assert admin.post(f"/admin/nodes/gpu/{gpu.pk}/change/", {"utilization": "1"}).status_code == 403


def test_task_groups_list_filter_show_their_members_and_stop_through_the_service(admin, world):
    waiting = task_services.create_group(
        world.tenants["acme"], {"name": "llm-a", "world_size": 2, "gpu_type": "nvidia", "image": "x"}
    )
    ended = task_services.create_group(
        world.tenants["beta"], {"name": "llm-b", "world_size": 1, "gpu_type": "ascend", "image": "x"}
    )
    task_services.stop_group(ended)
    listing = admin.get("/admin/tasks/taskgroup/").content.decode()
    assert "llm-a" in listing and "llm-b" in listing
    pending = admin.get("/admin/tasks/taskgroup/?status=pending").content.decode()
    assert "llm-a" in pending and "llm-b" not in pending
    assert "llm-b" in admin.get("/admin/tasks/taskgroup/?status=stopped").content.decode()
    assert "llm-a" not in admin.get("/admin/tasks/taskgroup/?gpu_type__exact=ascend").content.decode()
    assert "llm-b" not in admin.get("/admin/tasks/taskgroup/?q=llm-a").content.decode()
    page = admin.get(f"/admin/tasks/taskgroup/{waiting.pk}/change/").content.decode()
    assert "llm-a-0" in page and "llm-a-1" in page  # the members inline
    html = action(admin, "/admin/tasks/taskgroup/", "stop", waiting.pk)
    assert f"Task group #{waiting.pk} is stopped." in html
    assert set(Task.objects.filter(group=waiting).values_list("status", flat=True)) == {"cancelled"}
    html = action(admin, "/admin/tasks/taskgroup/", "stop", waiting.pk)
    assert "is stopped and cannot be stopped now" in html
    assert admin.get("/admin/tasks/taskgroup/add/").status_code == 403
    assert admin.post(f"/admin/tasks/taskgroup/{waiting.pk}/change/", {"world_size": 9}).status_code == 403
