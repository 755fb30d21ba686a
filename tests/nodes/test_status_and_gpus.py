"""The node state machine at its thresholds (controlled clock) and the lost-GPU judgement."""

from datetime import timedelta

import pytest

from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.core.guard import Outcome
from apps.nodes.liveness import status_at
from apps.nodes.models import Gpu, Node
from apps.nodes.services import refresh_node_statuses
from apps.tasks.models import Task
from tests.factories import make_task_holding
from tests.nodes.agents import Agents
from tests.nodes.payloads import gpu_stat
from tests.nodes.payloads import heartbeat as payload

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    "silent_seconds,executable,expected",
    [
        (0, True, "online"),
        (29.9, True, "online"),
        (29.9, False, "degraded"),
        (30, True, "suspect"),
        (30, False, "suspect"),
        (59.9, True, "suspect"),
        (60, True, "offline"),
        (3600, False, "offline"),
    ],
)
def test_status_at_the_thresholds(silent_seconds, executable, expected):
    now = utcnow()
    assert status_at(now - timedelta(seconds=silent_seconds), executable, now) == expected
    node = Node.objects.create(
        id=f"n-{silent_seconds}-{executable}",
        name="n",
        last_heartbeat_at=now - timedelta(seconds=silent_seconds),
        executable=executable,
        status="online" if executable else "degraded",  # what its last beat wrote
    )
    refresh_node_statuses(now=now)
    node.refresh_from_db()
    assert node.status == expected == node.status_at(now)


def test_the_health_checker_writes_only_changed_rows_and_reports_them():
    now = utcnow()
    Node.objects.create(id="fresh", name="fresh", last_heartbeat_at=now, status="online")
    Node.objects.create(id="quiet", name="quiet", last_heartbeat_at=now - timedelta(seconds=45), status="online")
    Node.objects.create(id="gone", name="gone", last_heartbeat_at=now - timedelta(seconds=90), status="suspect")
    assert refresh_node_statuses(now=now) == {"suspect": ["quiet"], "offline": ["gone"]}
    assert refresh_node_statuses(now=now) == {}


def test_the_health_checker_runs_as_a_guarded_periodic_job():
    from apps.nodes.jobs import check_health_job

    Node.objects.create(id="old", name="old", last_heartbeat_at=utcnow() - timedelta(minutes=2), status="online")
    assert check_health_job() == Outcome.RAN
    assert Node.objects.get(pk="old").status == "offline"
    assert check_health_job() == Outcome.EARLY


def gpus_of(node_id):
    return {g.index: g for g in Gpu.objects.filter(node_id=node_id)}


def test_a_card_absent_for_three_beats_is_lost_and_alerted_then_recovers_after_two(agents):
    agents.send("n1", payload(gpus=2))
    without_1 = payload(gpus=0, gpu_stats=[gpu_stat(0)])
    for _beat in range(2):
        agents.send("n1", without_1)
        assert gpus_of("n1")[1].lost_at is None
    agents.send("n1", without_1)
    lost = gpus_of("n1")[1]
    assert lost.lost_at is not None and lost.lost_basis == "heartbeat_absent" and lost.state == "lost"
    alert = Alert.objects.get(type="GPU_LOST")
    assert (alert.node_id, alert.gpu_index, alert.state, alert.severity) == ("n1", 1, "ACTIVE", "error")
    agents.send("n1", without_1)  # still lost: no second alert
    assert Alert.objects.filter(type="GPU_LOST").count() == 1
    # still counted in the totals
    assert Node.objects.get(pk="n1").gpu_count == 2
    agents.send("n1", payload(gpus=2))
    assert gpus_of("n1")[1].lost_at is not None
    agents.send("n1", payload(gpus=2))
    assert gpus_of("n1")[1].lost_at is None and gpus_of("n1")[1].lost_basis == ""
    assert Alert.objects.get(type="GPU_LOST").state == "RECOVERED"


def test_a_lost_card_leaves_one_event_on_each_task_that_holds_it(agents, monkeypatch):
    from apps.nodes.api import heartbeat as route
    from apps.nodes.jobs import record_card_losses_job
    from apps.tasks.models import TaskEvent
    from apps.tenants.services import create_tenant, delete_tenant

    asked = []
    monkeypatch.setattr(route, "enqueue", lambda name, *args: asked.append((name, args)))
    agents.send("n-trace", payload(gpus=2))
    tenant = create_tenant(name="Trace", slug="trace")
    node = Node.objects.get(pk="n-trace")
    on_lost = make_task_holding(node, tenant, "running", card=1)
    bystander = make_task_holding(node, tenant, "scheduled", card=0)
    without_1 = payload(gpus=0, gpu_stats=[gpu_stat(0)])
    for _beat in range(3):
        agents.send("n-trace", without_1)
    agents.send("n-trace", without_1)  # still lost: asked once, on the beat that judged it
    assert [(name, args) for name, args in asked if name == "nodes.record_card_losses"] == [
        ("nodes.record_card_losses", ("n-trace", [[1, "heartbeat_absent"]]))
    ]
    assert record_card_losses_job("n-trace", [[1, "heartbeat_absent"]]) == 1
    (event,) = TaskEvent.objects.filter(kind="gpu_lost")
    assert event.task_id == on_lost.pk and event.details == {
        "node_id": "n-trace",
        "gpu_index": 1,
        "basis": "heartbeat_absent",
    }
    assert "GPU 1 of node n-trace" in event.message and not bystander.events.exists()
    Task.objects.filter(tenant=tenant).delete()
    delete_tenant(tenant)


def test_collect_failures_and_mixed_basis(agents):
    agents.send("n2", payload(gpus=2))
    failing = payload(gpus=1, gpu_collect_failures=[{"index": 1, "error": "NVML_ERROR_GPU_IS_LOST"}])
    absent = payload(gpus=1)
    for beat in (failing, failing, failing):
        agents.send("n2", beat)
    assert gpus_of("n2")[1].lost_basis == "agent_collect_failure"
    agents.send("n3", payload(gpus=2))
    for beat in (failing, absent, absent):
        agents.send("n3", beat)
    assert gpus_of("n3")[1].lost_basis == "mixed"


def test_a_failing_card_reported_in_stats_too_is_not_read(agents):
    agents.send("n4", payload(gpus=2, gpu_collect_failures=[{"index": 1, "error": "timeout"}]))
    assert gpus_of("n4")[1].utilization is None and gpus_of("n4")[1].absent_streak == 1


def test_a_collector_wide_error_judges_nothing(agents):
    agents.send("n5", payload(gpus=2))
    agents.send("n5", payload(gpus=0, gpu_stats=[]))  # absent once
    broken = payload(gpus=0, gpu_stats=[], gpu_collector_error="nvidia-smi: not found")
    for _beat in range(5):
        agents.send("n5", broken)
    gpus = gpus_of("n5")
    assert all(g.lost_at is None and g.absent_streak == 1 for g in gpus.values())
    assert Node.objects.get(pk="n5").gpu_collector_error == "nvidia-smi: not found"


def test_the_counters_survive_a_restart_of_the_control_plane(agents):
    agents.send("n6", payload(gpus=2))
    agents.send("n6", payload(gpus=1))
    agents.send("n6", payload(gpus=1))
    restarted = Agents()  # a new process: new pool, nothing in memory
    try:
        restarted.send("n6", payload(gpus=1))
    finally:
        restarted.close()
    assert gpus_of("n6")[1].lost_at is not None


def test_biren_models_are_named_from_their_memory_size(agents):
    stats = [
        gpu_stat(0, vendor="biren", model="Biren GPU", memory_total_mb=32512),
        gpu_stat(1, vendor="biren", model="Biren GPU", memory_total_mb=65536),
    ]
    agents.send("n7", payload(gpus=0, gpu_stats=stats, gpu_capabilities={}))
    assert [g.model for g in Gpu.objects.filter(node_id="n7").order_by("index")] == ["BR106M", "BR100"]
    assert Node.objects.get(pk="n7").gpu_type == "biren"


def test_a_node_whose_gpus_cannot_be_read_is_degraded_alerted_and_recovers(agents, settings):
    from apps.alerts.failures import sweep_gpu_driver_errors

    agents.send("n-driver", payload(gpus=2))
    assert Node.objects.get(pk="n-driver").status == "online"
    failing = payload(gpus=0, gpu_stats=[], gpu_collector_error="nvidia-smi: Failed to initialize NVML: Driver/library")
    assert agents.send("n-driver", failing).json()["status"] == "degraded"
    node = Node.objects.get(pk="n-driver")
    assert node.status == "degraded" == node.status_at(utcnow())
    assert refresh_node_statuses(now=utcnow()) == {}  # the checker agrees: nothing to move
    assert sweep_gpu_driver_errors() == (["n-driver"], [])
    alert = Alert.objects.get(type="GPU_DRIVER_ERROR")
    assert (alert.node_id, alert.state, alert.severity) == ("n-driver", "ACTIVE", "error")
    assert "Failed to initialize NVML" in alert.message and alert.details["error"].startswith("nvidia-smi")
    assert sweep_gpu_driver_errors() == ([], [])  # still failing: no second alert
    agents.send("n-driver", failing)
    assert Alert.objects.filter(type="GPU_DRIVER_ERROR").count() == 1
    # it reads again: online with its next beat, the alert recovered by the next sweep
    assert agents.send("n-driver", payload(gpus=2)).json()["status"] == "online"
    assert sweep_gpu_driver_errors() == ([], ["n-driver"])
    assert Alert.objects.get(type="GPU_DRIVER_ERROR").state == "RECOVERED"


@pytest.mark.parametrize("executable,gpu_failing,expected", [(True, True, "degraded"), (False, True, "degraded")])
def test_a_failing_gpu_collector_degrades_a_node_heard_from(executable, gpu_failing, expected):
    now = utcnow()
    assert status_at(now, executable, now, gpu_failing=gpu_failing) == expected
    assert status_at(now - timedelta(seconds=45), executable, now, gpu_failing=gpu_failing) == "suspect"
