"""The portal's home lists the nodes the user may see and how each runs tasks."""

import pytest

from apps.nodes.models import Node

pytestmark = pytest.mark.django_db


def test_the_home_page_says_which_runtime_each_visible_node_offers(client, world):
    Node.objects.create(
        id="gpu-1", name="gpu-1", status="online", exec_mode="docker", executable=True, gpu_count=8, gpu_model="H100"
    )
    Node.objects.create(id="cpu-1", name="cpu-1", status="online", exec_mode="process", executable=True)
    Node.objects.create(
        id="idle-1",
        name="idle-1",
        status="degraded",
        exec_mode="none",
        executable=False,
        error_message="no container engine: socket missing",
    )
    Node.objects.create(
        id="beta-only", name="beta-only", status="online", exec_mode="docker", tenant=world.tenants["beta"]
    )
    client.force_login(world.operator)
    page = client.get("/portal/").content.decode()
    assert "containers (Docker-compatible engine)" in page and "8 × H100" in page
    assert "plain processes (no container engine)" in page
    assert "nothing: no container engine: socket missing" in page
    client.force_login(world.users["acme-viewer"])
    assert "beta-only" not in client.get("/portal/").content.decode()  # another tenant's dedicated node
