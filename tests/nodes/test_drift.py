"""Memory drift (apps.nodes.drift), judged in the heartbeat's own statement: measured use
the ledger does not explain, marked on the card, alerted after the beats, recovered once
it has ended for as long. Beats go through the real route (`agents`) on a controlled
clock."""

from datetime import timedelta

import pytest
import time_machine

from apps.alerts import keys as alert_keys
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.nodes.models import Gpu
from apps.scheduler.models import GpuAllocation
from apps.tasks.models import Task
from apps.tenants import services as tenant_services
from tests.factories import make_task
from tests.nodes.payloads import gpu_stat, heartbeat

pytestmark = pytest.mark.django_db(transaction=True)

GB = 1024
TOTAL = 80 * GB


def beat(agents, at, *used, node_id="n1", interval=5, **overrides):
    """One beat at `at` with each card's memory use (None: the card reads no memory)."""
    cards = []
    for index, mb in enumerate(used):
        card = gpu_stat(index, memory_total_mb=TOTAL, memory_used_mb=mb)
        if mb is None:
            del card["memory_used_mb"]
            card["metrics_available"] = ["utilization", "temperature", "power_w"]
        cards.append(card)
    with time_machine.travel(at, tick=False):
        payload = heartbeat(gpus=max(len(used), 1), gpu_stats=cards, heartbeat_interval=interval) | overrides
        response = agents.send(node_id, payload)
    assert response.status_code == 200, response.content


def card(node_id="n1", index=0):
    return Gpu.objects.get(node_id=node_id, index=index)


def alerts(node_id="n1", index=0, state=None):
    found = Alert.objects.filter(key=alert_keys.gpu_memory_drift(node_id, index))
    return found.filter(state=state) if state else found


def test_unknown_use_is_marked_then_alerted_after_the_beats_then_recovered(agents):
    now = utcnow().replace(microsecond=0)
    beat(agents, now, 30 * GB)  # an empty ledger: all of it is unexplained
    gpu = card()
    assert (gpu.memory_drift_since, gpu.memory_drift_mb) == (now, 30 * GB)
    assert not alerts().exists()
    beat(agents, now + timedelta(seconds=10), 30 * GB + 5)
    assert not alerts().exists()  # under 3 × 5 s
    gpu = card()
    assert (gpu.memory_drift_since, gpu.memory_drift_mb) == (now, 30 * GB + 5)  # the first sighting is kept
    beat(agents, now + timedelta(seconds=15), 30 * GB)
    alert = alerts(state="ACTIVE").get()
    assert (alert.type, alert.severity, alert.scope, alert.gpu_index) == ("GPU_MEMORY_DRIFT", "warning", "gpu", 0)
    assert alert.message == (
        "GPU 0 of node agent-n1 (n1) uses 30720 MB more memory than the platform placed on it "
        "(30720 MB measured, 0 MB explained by the ledger; threshold 2048 MB)."
    )
    assert alert.details == {"measured_mb": 30720, "explained_mb": 0, "drift_mb": 30720, "threshold_mb": 2048}
    beat(agents, now + timedelta(seconds=20), 30 * GB)
    assert alerts().count() == 1  # raised once
    beat(agents, now + timedelta(seconds=25), 1 * GB)  # the unknown process went away
    gpu = card()
    assert (gpu.memory_drift_since, gpu.memory_drift_ended_at) == (now, now + timedelta(seconds=25))
    assert alerts(state="ACTIVE").exists()  # ending: not yet for 3 × 5 s
    beat(agents, now + timedelta(seconds=35), 1 * GB)
    assert alerts(state="ACTIVE").exists()
    beat(agents, now + timedelta(seconds=40), 1 * GB)
    assert alerts(state="RECOVERED").count() == 1 and not alerts(state="ACTIVE").exists()
    gpu = card()
    assert (gpu.memory_drift_since, gpu.memory_drift_mb, gpu.memory_drift_ended_at) == (None, None, None)


def test_a_drift_hovering_at_the_threshold_keeps_one_alert(agents):
    """Use that crosses the threshold every other beat is one drift: a dip shorter than
    the span neither restarts its count nor recovers its alert."""
    now = utcnow().replace(microsecond=0)
    for k in range(24):  # two minutes, over and under the threshold by turns
        beat(agents, now + timedelta(seconds=5 * k), (3 if k % 2 == 0 else 1) * GB)
        if k == 4:
            assert alerts(state="ACTIVE").exists()  # over, 20 s after the first sighting, dips and all
    assert alerts().count() == 1 and alerts(state="ACTIVE").exists()
    assert card().memory_drift_since == now
    ended = now + timedelta(seconds=5 * 23)
    for k in range(1, 4):
        beat(agents, ended + timedelta(seconds=5 * k), 1 * GB)
    assert alerts().count() == 1 and alerts(state="RECOVERED").exists()
    beat(agents, ended + timedelta(seconds=20), 3 * GB)  # a new drift: a new count from now
    assert card().memory_drift_since == ended + timedelta(seconds=20)
    assert alerts().count() == 1


@pytest.fixture
def acme():
    tenant = tenant_services.create_tenant(name="Drift", slug="drift")
    yield tenant
    Task.objects.filter(tenant=tenant).delete()
    tenant_services.delete_tenant(tenant)


def test_what_the_ledger_holds_explains_the_use(agents, acme):
    now = utcnow()
    beat(agents, now, 1 * GB, 1 * GB)
    node = card().node
    share = make_task(acme, status="running", node=node)
    GpuAllocation.objects.create(task=share, node=node, gpu_index=0, tenant=acme, memory_mb=20 * GB)
    whole = make_task(acme, status="running", node=node)  # a whole-card holder explains all
    GpuAllocation.objects.create(task=whole, node=node, gpu_index=1, tenant=acme, memory_mb=None)
    beat(agents, now + timedelta(seconds=5), 20 * GB + 2048, 79 * GB)  # at the threshold, not above
    assert card(index=0).memory_drift_since is None and card(index=1).memory_drift_since is None
    beat(agents, now + timedelta(seconds=10), 20 * GB + 2049, 79 * GB)
    assert card(index=0).memory_drift_mb == 2049 and card(index=1).memory_drift_since is None


def test_the_beats_are_the_nodes_own_interval(agents):
    now = utcnow()
    for seconds, raised in ((0, False), (30, False), (60, False), (90, True)):
        beat(agents, now + timedelta(seconds=seconds), 30 * GB, interval=30)
        assert alerts(state="ACTIVE").exists() is raised, seconds


def test_a_lost_card_is_not_judged(agents):
    now = utcnow()
    beat(agents, now, 1 * GB)
    Gpu.objects.filter(node_id="n1").update(lost_at=now)
    beat(agents, now + timedelta(seconds=5), 30 * GB)
    assert card().memory_drift_since is None
    # a drift marked before the card was lost stays as it was while it is lost
    Gpu.objects.filter(node_id="n1").update(lost_at=None)
    beat(agents, now + timedelta(seconds=10), 30 * GB)
    Gpu.objects.filter(node_id="n1").update(lost_at=now)
    beat(agents, now + timedelta(seconds=15), 1 * GB)
    assert card().memory_drift_mb == 30 * GB


def test_a_card_that_stops_reporting_memory_ends_its_drift(agents):
    now = utcnow()
    beat(agents, now, 30 * GB)
    beat(agents, now + timedelta(seconds=15), 30 * GB)
    assert alerts(state="ACTIVE").exists()
    beat(agents, now + timedelta(seconds=20), None)
    beat(agents, now + timedelta(seconds=35), None)
    assert card().memory_drift_since is None and alerts(state="RECOVERED").exists()


def test_a_beat_whose_collector_failed_judges_nothing(agents):
    now = utcnow()
    beat(agents, now, 30 * GB)
    beat(agents, now + timedelta(seconds=15), 30 * GB)
    beat(agents, now + timedelta(seconds=20), gpu_stats=[], gpu_collector_error="nvidia-smi timed out")
    assert card().memory_drift_mb == 30 * GB and alerts(state="ACTIVE").exists()
    beat(agents, now + timedelta(seconds=25), 1 * GB)  # read again: the drift is ending
    assert alerts(state="ACTIVE").exists()
    beat(agents, now + timedelta(seconds=40), 1 * GB)
    assert card().memory_drift_since is None and alerts(state="RECOVERED").exists()


def test_the_threshold_is_the_setting(agents, settings):
    settings.HETEROFLOW_GPU_MEMORY_DRIFT_MB = 100
    beat(agents, utcnow(), 500)
    assert card().memory_drift_mb == 500


def test_two_nodes_drift_apart(agents):
    """One beat judges its own node's cards only."""
    now = utcnow()
    beat(agents, now, 30 * GB, node_id="n1")
    beat(agents, now, 1 * GB, node_id="n2")
    assert card("n1").memory_drift_mb == 30 * GB and card("n2").memory_drift_since is None
    beat(agents, now + timedelta(seconds=15), 1 * GB, node_id="n2")
    assert card("n1").memory_drift_mb == 30 * GB  # n2's beats leave n1's marks alone


def test_an_alert_the_dispatcher_holds_is_recovered_by_a_later_recheck_never_waited_for(agents, monkeypatch):
    """The outbox's dispatcher holds the alert rows it claims until it commits: a beat
    skips such a row (it never waits on the outbox) and the node's next recheck beat
    (about once a minute) recovers it; the beats between probe nothing."""
    from apps.nodes import heartbeat

    rechecks = []
    monkeypatch.setattr(heartbeat, "rechecks_alerts", lambda node_id, now, interval: bool(rechecks and rechecks[-1]))
    from concurrent.futures import ThreadPoolExecutor

    import psycopg

    from apps.core.db import libpq_params

    now = utcnow()
    beat(agents, now, 30 * GB)
    beat(agents, now + timedelta(seconds=15), 30 * GB)
    alert = alerts(state="ACTIVE").get()
    beat(agents, now + timedelta(seconds=20), 1 * GB)  # the drift is ending
    with psycopg.connect(**libpq_params()) as dispatcher, ThreadPoolExecutor(1) as thread:
        dispatcher.execute("SELECT id FROM alerts WHERE id = %s FOR UPDATE", [alert.pk])
        ending = thread.submit(beat, agents, now + timedelta(seconds=35), 1 * GB)  # the drift ends
        try:
            ending.result(timeout=10)  # a beat that waited for the row would still be waiting
        finally:
            dispatcher.rollback()
    assert card().memory_drift_since is None and alerts(state="ACTIVE").exists()
    rechecks.append(False)
    beat(agents, now + timedelta(seconds=40), 1 * GB)  # not a recheck: the drift ended before it
    assert alerts(state="ACTIVE").get().pk == alert.pk
    rechecks.append(True)
    beat(agents, now + timedelta(seconds=45), 1 * GB)
    assert alerts(state="RECOVERED").get().pk == alert.pk


def test_each_node_rechecks_one_beat_in_twelve_spread_over_the_nodes():
    from apps.nodes.heartbeat import RECHECK_EVERY_BEATS, rechecks_alerts

    start = utcnow()
    beats = [start + timedelta(seconds=5 * k) for k in range(120)]
    per_node = {node: [rechecks_alerts(node, at, 5) for at in beats] for node in ("n1", "n2", "n3", "gpu-07")}
    assert all(sum(marks) == 120 // RECHECK_EVERY_BEATS for marks in per_node.values())
    first = {marks.index(True) for marks in per_node.values()}
    assert len(first) > 1  # not every node on the same beat
    # a 30 s beat rechecks once in 12 of its own beats too
    assert sum(rechecks_alerts("n1", start + timedelta(seconds=30 * k), 30) for k in range(120)) == 10
