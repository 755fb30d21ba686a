"""GET /api/v1/tasks/{id}/metrics: the readings of the cards a task holds, from the
heartbeats' samples of its node (beats through the real route, hence committed data)."""

from datetime import timedelta

import pytest
import time_machine

from apps.core.clock import utcnow
from apps.scheduler.models import GpuAllocation
from apps.tasks.choices import TaskStatus
from apps.tasks.models import Task
from tests.factories import build_world, make_task
from tests.headers import bearer
from tests.nodes.payloads import gpu_stat
from tests.nodes.payloads import heartbeat as payload

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def worlds():
    world = build_world()
    yield world
    Task.objects.all().delete()


def beat(agents, node_id, now, power):
    stats = [gpu_stat(0, power_w=100.0, utilization=5.0), gpu_stat(1, power_w=power, utilization=90.0)]
    with time_machine.travel(now, tick=False):
        assert agents.send(node_id, payload(gpus=2, gpu_stats=stats)).status_code == 200


def test_a_tasks_metrics_are_its_own_cards_readings_over_the_window(agents, api, worlds):
    start = utcnow() - timedelta(minutes=10)
    beat(agents, "metrics-node", start, 200.0)
    task = make_task(
        worlds.tenants["acme"], status=TaskStatus.RUNNING, node_id="metrics-node", gpu_required=1, started_at=start
    )
    GpuAllocation.objects.create(task=task, node_id="metrics-node", gpu_index=1, tenant=worlds.tenants["acme"])
    for minute, power in ((2, 300.0), (4, 400.0), (6, 500.0)):
        beat(agents, "metrics-node", start + timedelta(minutes=minute), power)

    key = bearer(worlds.keys["acme-viewer"])
    body = api.get(f"/api/v1/tasks/{task.pk}/metrics?window=15m", **key).json()
    assert body["gpu_indices"] == [1] and body["node_id"] == "metrics-node" and body["window_seconds"] == 900
    cards = [card for sample in body["samples"] for card in sample["gpus"]]
    assert {card["index"] for card in cards} == {1}  # never the card the task does not hold
    assert [card["power_w"] for card in cards] == [200.0, 300.0, 400.0, 500.0]
    assert all(card["utilization"] == 90.0 for card in cards)

    recent = api.get(f"/api/v1/tasks/{task.pk}/metrics?window=7m", **key).json()
    assert [card["power_w"] for sample in recent["samples"] for card in sample["gpus"]] == [400.0, 500.0]

    assert api.get(f"/api/v1/tasks/{task.pk}/metrics", **bearer(worlds.keys["beta-viewer"])).status_code == 404
    bad = api.get(f"/api/v1/tasks/{task.pk}/metrics?window=3d", **key)
    assert bad.status_code == 400 and "window" in bad.json()["error"]["fields"]


def test_a_task_holding_no_card_has_no_samples(api, worlds):
    task = make_task(worlds.tenants["acme"], status=TaskStatus.PENDING)
    body = api.get(f"/api/v1/tasks/{task.pk}/metrics", **bearer(worlds.keys["acme-viewer"])).json()
    assert body["gpu_indices"] == [] and body["samples"] == [] and body["status"] == "pending"
