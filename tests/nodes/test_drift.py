"""Memory drift (apps.nodes.drift): measured use the ledger does not explain, marked on
the card, alerted after the beats, recovered when it ends (controlled clock)."""

from datetime import timedelta

import pytest

from apps.alerts import keys as alert_keys
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.core.guard import Outcome
from apps.nodes.drift import check_memory_drift
from apps.nodes.models import Gpu
from apps.scheduler.models import GpuAllocation
from tests.factories import make_node, make_task, make_task_holding

pytestmark = pytest.mark.django_db

GB = 1024


def reading(node_id, used, index=0):
    Gpu.objects.filter(node_id=node_id, index=index).update(memory_used_mb=used)


def card(node_id, index=0):
    return Gpu.objects.get(node_id=node_id, index=index)


def alerts(node_id="n1", index=0, state=None):
    found = Alert.objects.filter(key=alert_keys.gpu_memory_drift(node_id, index))
    return found.filter(state=state) if state else found


def test_unknown_use_is_marked_then_alerted_after_the_beats_then_recovered():
    now = utcnow()
    make_node("n1", gpus=1, heartbeat_interval=5, last_heartbeat_at=now)
    reading("n1", 30 * GB)  # an empty ledger: all of it is unexplained
    report = check_memory_drift(now=now)
    assert report.marked == [("n1", 0)] and report.raised == []
    gpu = card("n1")
    assert (gpu.memory_drift_since, gpu.memory_drift_mb) == (now, 30 * GB)
    assert check_memory_drift(now=now + timedelta(seconds=14)).raised == []  # under 3 × 5 s
    assert card("n1").memory_drift_since == now  # the first sighting is kept
    assert check_memory_drift(now=now + timedelta(seconds=15)).raised == [("n1", 0)]
    alert = alerts(state="ACTIVE").get()
    assert (alert.type, alert.severity, alert.scope, alert.gpu_index) == ("GPU_MEMORY_DRIFT", "warning", "gpu", 0)
    assert "GPU 0 of node n1" in alert.message and "30720 MB" in alert.message
    assert alert.details == {"measured_mb": 30720, "explained_mb": 0, "drift_mb": 30720, "threshold_mb": 2048}
    assert check_memory_drift(now=now + timedelta(seconds=20)).raised == []  # raised once
    assert alerts().count() == 1
    reading("n1", 1 * GB)  # the unknown process went away
    assert check_memory_drift(now=now + timedelta(seconds=30)).recovered == [("n1", 0)]
    assert alerts(state="RECOVERED").count() == 1 and not alerts(state="ACTIVE").exists()
    gpu = card("n1")
    assert (gpu.memory_drift_since, gpu.memory_drift_mb) == (None, None)


def test_what_the_ledger_holds_explains_the_use(world):
    acme = world.tenants["acme"]
    now = utcnow()
    node = make_node("n1", gpus=2, last_heartbeat_at=now)
    share = make_task(acme, status="running", node=node)
    GpuAllocation.objects.create(task=share, node=node, gpu_index=0, tenant=acme, memory_mb=20 * GB)
    reading("n1", 20 * GB + 2048)  # 2,048 MB beyond the share: at the threshold, not above
    make_task_holding(node, acme, "running", card=1)  # a whole-card holder explains all
    reading("n1", 79 * GB, index=1)
    assert check_memory_drift(now=now).marked == []
    reading("n1", 20 * GB + 2049)
    assert check_memory_drift(now=now).marked == [("n1", 0)]
    assert card("n1").memory_drift_mb == 2049


def test_the_beats_are_the_nodes_own_interval():
    now = utcnow()
    node = make_node("n1", gpus=1, heartbeat_interval=30, last_heartbeat_at=now)
    reading("n1", 30 * GB)
    check_memory_drift(now=now)
    for seconds, raised in ((30, []), (60, []), (90, [("n1", 0)])):
        later = now + timedelta(seconds=seconds)
        node.__class__.objects.filter(pk=node.pk).update(last_heartbeat_at=later)  # it keeps beating
        assert check_memory_drift(now=later).raised == raised


def test_a_stale_reading_of_a_node_given_up_and_a_lost_card_are_not_judged():
    now = utcnow()
    make_node("gone", gpus=1, last_heartbeat_at=now - timedelta(minutes=5), status="offline")
    reading("gone", 30 * GB)
    make_node("n1", gpus=1, last_heartbeat_at=now)
    reading("n1", 30 * GB)
    Gpu.objects.filter(node_id="n1").update(lost_at=now)
    assert check_memory_drift(now=now).marked == []
    assert card("gone").memory_drift_since is None and card("n1").memory_drift_since is None


def test_a_card_that_stops_reporting_memory_ends_its_drift():
    now = utcnow()
    make_node("n1", gpus=1, last_heartbeat_at=now)
    reading("n1", 30 * GB)
    check_memory_drift(now=now)
    check_memory_drift(now=now + timedelta(seconds=15))
    reading("n1", None)
    assert check_memory_drift(now=now + timedelta(seconds=20)).recovered == [("n1", 0)]
    assert card("n1").memory_drift_since is None and alerts(state="RECOVERED").exists()


def test_the_drift_check_runs_as_a_guarded_periodic_job(settings):
    from apps.nodes.jobs import memory_drift_job

    settings.HETEROFLOW_GPU_MEMORY_DRIFT_MB = 100
    make_node("n1", gpus=1, last_heartbeat_at=utcnow())
    reading("n1", 500)
    assert memory_drift_job() == Outcome.RAN
    assert card("n1").memory_drift_mb == 500
    assert memory_drift_job() == Outcome.EARLY
