"""The truth about the cards, end to end: a real agent process over a stateful stand-in
nvidia-smi (two 80 GB A100s), the whole control plane (web, Celery worker and beat).

1. Energy: the cards' measured power fills their accumulators beat by beat, and the
   node's energy API answers in kWh (not null) while it is running.
2. Health: uncorrected ECC errors appear on card 1 under the running agent (its next
   health read, every 5 s here): the server cordons card 1 alone with GPU_UNHEALTHY and
   the evidence; a two-card task waits (`cordoned`), a one-card task runs on card 0.
   An operator uncordons it.
3. Measured-free admission and drift: 30 GB in use on each card by something the
   platform did not place: a 60 GB share waits (`memory_in_use`), the drift alerts are
   raised; card 0's memory is freed: its alert recovers and the share runs there."""

from __future__ import annotations

import os
import sys

import pytest
import redis
from django.conf import settings

from agent.tests.slicing_host import Cards
from apps.alerts import keys as alert_keys
from apps.alerts.models import Alert
from apps.nodes import gpu_health_services, metrics
from apps.nodes.models import Gpu, Node
from apps.scheduler.services import set_plugin_options
from apps.tasks.models import Task
from apps.tenants.services import create_tenant
from tests.faults.cluster import ControlPlane
from tests.live import start_agent, stop_process, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
A100_80 = "NVIDIA A100-SXM4-80GB"
SHOW_CARDS = "import os; print('CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', ''))"
QUICK = {"HETEROFLOW_RECONCILE_SECONDS": "5", "HETEROFLOW_REPORT_ATTEMPTS": "2", "HETEROFLOW_HEALTH_SECONDS": "5"}


def active(key: str) -> bool:
    return Alert.objects.filter(key=key, state="ACTIVE").exists()


def test_a_failing_card_is_cordoned_memory_in_use_is_respected_and_energy_is_counted(tmp_path):
    redis.Redis.from_url(settings.REDIS_URL).delete("celery")  # no ticks queued by earlier tests
    plane = ControlPlane(tmp_path).start()
    cards = Cards(tmp_path)
    cards.nvidia(count=2, model=A100_80, mig=False, memory_mb=81920)
    agent = start_agent(
        plane.url,
        tmp_path / "agent",
        PATH=f"{cards.root / 'usr/bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        **QUICK,
    )

    def logs() -> str:
        return plane.logs() + f"\n--- agent\n{agent.log_path.read_text()[-4000:]}"

    try:
        wait_until(
            lambda: Node.objects.filter(status="online", gpu_type="nvidia", gpu_count=2).exists(),
            90,
            f"the node online with its two cards\n{logs()}",
        )
        node = Node.objects.get(gpu_type="nvidia", gpu_count=2)
        tenant = create_tenant(name="Truth", slug="truth")
        set_plugin_options("resource-filter", extra={"cpu_percent_max": 100, "memory_percent_max": 100})

        # 1. energy: 52.1 W measured on each card, integrated between beats
        wait_until(
            lambda: all(gpu.energy_wh > 0 for gpu in Gpu.objects.filter(node=node)),
            60,
            f"both cards' accumulators growing\n{logs()}",
        )
        energy = metrics.energy(node.pk, 1, node.heartbeat_interval)
        assert energy["gpu_energy_kwh"] is not None and energy["gpu_energy_kwh"] > 0

        # 2. health: card 1 reports uncorrected errors under the running agent
        wait_until(
            lambda: Gpu.objects.filter(node=node).exclude(health={}).count() == 2,
            60,
            f"both cards' health read\n{logs()}",
        )
        cards.health(1, ecc_uncorrected_volatile=3, ecc_uncorrected_aggregate=3)
        wait_until(
            lambda: Gpu.objects.get(node=node, index=1).cordoned_at is not None,
            60,
            f"card 1 cordoned\n{logs()}",
        )
        sick, well = Gpu.objects.get(node=node, index=1), Gpu.objects.get(node=node, index=0)
        assert sick.cordon_source == "health" and well.cordoned_at is None
        alert = Alert.objects.get(key=alert_keys.gpu_unhealthy(node.pk, 1), state="ACTIVE")
        assert "ecc_uncorrected_volatile" in str(alert.details)

        both = Task.objects.create(
            tenant=tenant, name="two-cards", gpu_required=2, gpu_type="nvidia", command=[sys.executable, "-c", "0"]
        )
        one = Task.objects.create(
            tenant=tenant,
            name="one-card",
            gpu_required=1,
            gpu_type="nvidia",
            command=[sys.executable, "-c", SHOW_CARDS],
        )
        wait_until(
            lambda: Task.objects.get(pk=one.pk).status == "completed",
            90,
            f"the one-card task completed ({Task.objects.get(pk=one.pk).status})\n{logs()}",
        )
        assert "CUDA_VISIBLE_DEVICES=0\n" in Task.objects.get(pk=one.pk).log_tail + "\n"
        wait_until(
            lambda: "cordoned" in Task.objects.get(pk=both.pk).schedule_reason.get("removed_by", {}),
            30,
            f"the two-card task waiting for the cordoned card ({Task.objects.get(pk=both.pk).schedule_reason})",
        )
        assert Task.objects.get(pk=both.pk).status == "pending"
        Task.objects.filter(pk=both.pk).update(status="cancelled")

        # an operator puts card 1 back (its alert recovers); the same reading again does
        # not cordon it a second time
        gpu_health_services.uncordon_card(node, 1, None)
        assert not active(alert_keys.gpu_unhealthy(node.pk, 1))

        # 3. 30 GB in use on each card that the platform did not place
        cards.load(0, memory_used_mb=30720)
        cards.load(1, memory_used_mb=30720)
        wait_until(
            lambda: set(Gpu.objects.filter(node=node).values_list("memory_used_mb", flat=True)) == {30720},
            30,
            f"the readings\n{logs()}",
        )
        share = Task.objects.create(
            tenant=tenant,
            name="share-60g",
            gpu_required=0,
            gpu_memory_mb=61440,
            gpu_type="nvidia",
            command=[sys.executable, "-c", SHOW_CARDS],
        )
        wait_until(lambda: active(alert_keys.gpu_memory_drift(node.pk, 0)), 60, f"the drift alert on card 0\n{logs()}")
        wait_until(
            lambda: "memory_in_use" in Task.objects.get(pk=share.pk).schedule_reason.get("removed_by", {}),
            30,
            f"the share waiting for measured memory ({Task.objects.get(pk=share.pk).schedule_reason})",
        )
        assert Task.objects.get(pk=share.pk).status == "pending"
        assert Gpu.objects.get(node=node, index=1).cordoned_at is None

        cards.load(0, memory_used_mb=0)
        wait_until(
            lambda: Task.objects.get(pk=share.pk).status == "completed",
            90,
            f"the share ran once card 0's memory was freed ({Task.objects.get(pk=share.pk).status})\n{logs()}",
        )
        assert "CUDA_VISIBLE_DEVICES=0\n" in Task.objects.get(pk=share.pk).log_tail + "\n"
        wait_until(lambda: not active(alert_keys.gpu_memory_drift(node.pk, 0)), 60, "card 0's drift alert recovered")
        assert active(alert_keys.gpu_memory_drift(node.pk, 1))
    finally:
        stop_process(agent)
        plane.stop()
