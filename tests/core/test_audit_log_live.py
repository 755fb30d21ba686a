"""The audit log under the ASGI server (uvicorn, as `make up` serves): the middleware's
async path records a change once, and a service's own record is not doubled by it."""

from __future__ import annotations

import httpx
import pytest
from django_tenants.utils import schema_context

from apps.confidential.models import AuditEvent
from apps.core.models import OperatorAuditEvent
from apps.tenants.services import create_tenant, issue_platform_key
from tests.factories import OperatorFactory, make_task
from tests.headers import bearer_http
from tests.live import start_control_plane, stop_process


def actions_in(tenant) -> list[str]:
    with schema_context(tenant.schema_name):
        return list(AuditEvent.objects.order_by("at", "id").values_list("action", flat=True))


@pytest.mark.django_db(transaction=True)
def test_under_the_asgi_server_changes_are_recorded_once(tmp_path):
    """The middleware's async path (uvicorn, as `make up` serves): a group created through
    Django (its service records it: once) and a stop (recorded by its request)."""
    operator = OperatorFactory(username="asgi-op")
    key = issue_platform_key(user=operator, name="ops").key
    acme = create_tenant(name="Asgi", slug="asgi")
    task = make_task(acme, name="asgi-stop")
    server, url = start_control_plane()
    try:
        group = {
            "tenant": "asgi",
            "name": "g",
            "image": "x",
            "world_size": 2,
            "gpus_per_worker": 1,
            "gpu_type": "nvidia",
        }
        created = httpx.post(f"{url}/api/v1/task-groups", json=group, headers=bearer_http(key))
        assert created.status_code == 201, created.text
        stopped = httpx.post(f"{url}/api/v1/tasks/{task.pk}/stop", headers=bearer_http(key))
        assert stopped.status_code == 200, stopped.text
    finally:
        stop_process(server)
    actions = actions_in(acme)
    assert actions.count("task_group.created") == 1 and "POST /api/v1/task-groups" not in actions
    assert actions.count("POST /api/v1/tasks/<int:pk>/stop") == 1
    # an operator's changes are in both logs (the tenant's creation by the test is not one)
    operators = OperatorAuditEvent.objects.order_by("at", "id").values_list("action", flat=True)
    assert list(operators) == ["task_group.created", "POST /api/v1/tasks/<int:pk>/stop"]
