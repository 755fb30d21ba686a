"""The inference services' periodic rounds on recorded state: the rebuild (state from
health, died replicas requeued with the crash-loop back-off and alert, a dead node's
replica taken back to the queue, a node that cannot be read left alone, stopping →
stopped), the AutoScaler on the gateway's Redis signals and the heartbeats' GPU
utilisation (absent keys are no signal; decisions recorded without flooding), sleep and
the wake task, the wake time-out, and the windows (pause and restore, the inactive
tenant's skip)."""

from datetime import UTC, datetime, timedelta

import pytest
import time_machine

from apps.alerts import keys as alert_keys
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.inference import jobs, load_readings, rounds, services
from apps.inference.models import InferenceService, ServiceDecision
from apps.nodes.models import Gpu, Node
from apps.scheduler.models import GpuAllocation
from apps.tasks import services as task_services
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task, TaskEvent
from tests.factories import make_node
from tests.inference.services_helpers import make_service, member, set_quota

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def clean_signals():
    def wipe():
        with load_readings.client() as redis:
            keys = list(redis.scan_iter("hf:svc:*"))
            if keys:
                redis.delete(*keys)

    wipe()
    yield
    wipe()


def svc(service) -> InferenceService:
    return InferenceService.objects.select_related("group", "model").get(pk=service.pk)


def slots(service) -> list[tuple[int, str]]:
    return list(Task.objects.filter(group_id=service.pk).order_by("rank").values_list("rank", "status"))


def task_of(service, rank: int) -> Task:
    return Task.objects.get(group_id=service.pk, rank=rank)


def run(service, rank: int, node: Node, *, healthy: bool = True, port: int = 8000) -> Task:
    """The replica of `rank` running on `node`, its health as the node's last beat said."""
    task = task_of(service, rank)
    Task.objects.filter(pk=task.pk).update(status=S.RUNNING, node=node, host_port=port + rank, started_at=utcnow())
    health = [entry for entry in Node.objects.get(pk=node.pk).task_health if entry["task_id"] != task.pk]
    Node.objects.filter(pk=node.pk).update(
        task_health=[*health, {"task_id": task.pk, "healthy": healthy}], last_heartbeat_at=utcnow()
    )
    return task


def die(service, rank: int) -> None:
    Task.objects.filter(group_id=service.pk, rank=rank).update(status=S.FAILED, finished_at=utcnow())


def set_state(service, state: str, **fields) -> InferenceService:
    InferenceService.objects.filter(pk=service.pk).update(state=state, **fields)
    return svc(service)


def decisions(service, source: str | None = None) -> list[tuple[str, str]]:
    rows = ServiceDecision.objects.filter(service_id=service.pk).order_by("id")
    if source:
        rows = rows.filter(source=source)
    return list(rows.values_list("source", "action"))


# --- rebuild -------------------------------------------------------------------------------


def test_a_healthy_replica_makes_the_service_running_and_none_makes_it_starting(world):
    service = make_service(world)
    node = make_node("rb-1", 4)
    run(service, 0, node, healthy=False)
    rounds.rebuild_round()
    assert svc(service).state == "starting"
    run(service, 0, node, healthy=True)
    assert rounds.rebuild_round().moved == {service.pk: "healthy"}
    assert svc(service).state == "running"
    run(service, 0, node, healthy=False)
    rounds.rebuild_round()
    assert svc(service).state == "starting"
    assert slots(service) == [(0, "running"), (1, "pending")]  # nothing rebuilt: both are coming


def test_a_replica_the_agent_reports_failed_ends_alone_and_is_requeued_at_once(world):
    service = make_service(world)
    node = make_node("rb-2", 4)
    first, second = run(service, 0, node), run(service, 1, node)
    rounds.rebuild_round()
    # the agent's report: the group is not ended with it (placement replicas)
    assert task_services.agent_report(first, from_status=S.RUNNING, to_status=S.FAILED, exit_code=137)
    assert slots(service) == [(0, "failed"), (1, "running")]
    result = rounds.rebuild_round()
    assert result.rebuilt == [(service.pk, 0, "recreate")]
    assert slots(service) == [(0, "pending"), (1, "running")]
    rebuilt = task_of(service, 0)
    assert rebuilt.pk == first.pk and rebuilt.node_id is None and rebuilt.exit_code is None
    event = TaskEvent.objects.get(task_id=first.pk, kind="replica_requeued")
    assert event.details["crash_restart"] is True
    assert ("rebuild", "recreate") in decisions(service)
    assert svc(service).state == "running" and second.pk == task_of(service, 1).pk


def test_a_crash_loop_backs_off_raises_one_alert_and_recovers_when_healthy(world):
    service = make_service(world, min_replicas=1, max_replicas=1)
    node = make_node("rb-3", 4)
    start = utcnow()
    with time_machine.travel(start, tick=False) as clock:
        waits = []
        for _ in range(5):  # five deaths, each rebuilt after its back-off
            run(service, 0, node, healthy=False)
            die(service, 0)
            waited = 0
            while not rounds.rebuild_round().rebuilt:
                clock.shift(5)
                waited += 5
                Node.objects.filter(pk=node.pk).update(last_heartbeat_at=utcnow())  # the node stays alive
            waits.append(waited)
        assert waits == [0, 10, 20, 40, 80]
        assert not Alert.objects.filter(key=alert_keys.inference_crash_loop(task_of(service, 0).pk)).exists()
        # the sixth death within the crash window: the alert, once, and the capped back-off
        run(service, 0, node, healthy=False)
        die(service, 0)
        result = rounds.rebuild_round()
        task_id = task_of(service, 0).pk
        assert result.alerts == [task_id] and result.backing_off == [(service.pk, 0)]
        assert rounds.rebuild_round().alerts == []
        alert = Alert.objects.get(key=alert_keys.inference_crash_loop(task_id))
        assert alert.state == "ACTIVE" and alert.task_id == task_id and alert.tenant_id == world.tenants["acme"].pk
        assert "crash-looping" in alert.message
        clock.shift(160)
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=utcnow())
        assert rounds.rebuild_round().rebuilt == [(service.pk, 0, "recreate")]
        run(service, 0, node, healthy=True)
        assert rounds.rebuild_round().recovered == [task_id]
        assert Alert.objects.get(pk=alert.pk).state == "RECOVERED"


def test_a_dead_nodes_replica_goes_back_to_the_queue_and_an_unread_node_is_left_alone(world):
    service = make_service(world)
    dead = make_node("rb-dead", 4)
    silent = make_node("rb-silent", 4)
    run(service, 0, dead)
    run(service, 1, silent)
    set_state(service, "running")
    Node.objects.filter(pk="rb-dead").update(last_heartbeat_at=utcnow() - timedelta(seconds=120))
    Node.objects.filter(pk="rb-silent").update(last_heartbeat_at=utcnow() - timedelta(seconds=35))
    result = rounds.rebuild_round()
    assert result.rebuilt == [(service.pk, 0, "recreate_elsewhere")]
    assert slots(service) == [(0, "pending"), (1, "running")]
    moved = task_of(service, 0)
    assert moved.node_id is None and moved.host_port is None
    event = TaskEvent.objects.get(task_id=moved.pk, kind="replica_requeued")
    assert event.details == {"rank": 0, "crash_restart": False, "dead_node": "rb-dead"}


def test_a_missing_rank_below_the_count_is_created_and_a_surplus_dead_one_left(world):
    service = make_service(world, min_replicas=1, max_replicas=3)
    node = make_node("rb-4", 4)
    run(service, 0, node)
    InferenceService.objects.filter(pk=service.pk).update(replicas=2)
    rounds.rebuild_round()
    assert slots(service) == [(0, "running"), (1, "pending")]
    services.scale_service(svc(service), 1, source="user", reason="less")
    assert slots(service) == [(0, "running"), (1, "cancelled")]
    assert rounds.rebuild_round().rebuilt == []
    assert slots(service) == [(0, "running"), (1, "cancelled")]


def test_a_slot_stopped_on_purpose_below_the_count_is_recreated_without_counting_as_a_crash(world):
    service = make_service(world)
    run(service, 0, make_node("rb-9", 4))
    task_services.stop_task(task_of(service, 1))  # someone cancelled the queued replica
    assert slots(service) == [(0, "running"), (1, "cancelled")]
    assert rounds.rebuild_round().rebuilt == [(service.pk, 1, "recreate")]
    event = TaskEvent.objects.get(task_id=task_of(service, 1).pk, kind="replica_requeued")
    assert event.details["crash_restart"] is False


def test_a_rebuild_the_quota_has_no_room_for_waits(world):
    service = make_service(world, min_replicas=1, max_replicas=1)
    node = make_node("rb-5", 4)
    run(service, 0, node)
    die(service, 0)
    set_quota(world, max_gpus=1)
    result = rounds.rebuild_round()
    assert result.rebuilt == [] and result.refused and slots(service) == [(0, "failed")]
    set_quota(world, max_gpus=None)
    assert rounds.rebuild_round().rebuilt == [(service.pk, 0, "recreate")]


def test_a_stopping_service_is_stopped_once_every_replica_has_ended(world):
    service = make_service(world)
    node = make_node("rb-6", 4)
    run(service, 0, node)
    services.stop_service(member(world), svc(service))
    assert slots(service) == [(0, "stopping"), (1, "cancelled")]
    rounds.rebuild_round()
    assert svc(service).state == "stopping"
    Task.objects.filter(group_id=service.pk, rank=0).update(status=S.STOPPED)
    assert rounds.rebuild_round().moved == {service.pk: "ended"}
    assert svc(service).state == "stopped"


def test_a_replica_queued_where_none_should_run_is_stopped(world):
    asleep = make_service(world, name="asleep")
    set_state(asleep, "sleeping")
    Task.objects.filter(group_id=asleep.pk, rank=1).update(status=S.STOPPED)  # rank 0 stays queued: a stray
    running = make_service(world, name="running", min_replicas=1, max_replicas=3)
    node = make_node("rb-7", 8)
    run(running, 0, node)
    InferenceService.objects.filter(pk=running.pk).update(replicas=2)
    services.start_slots(svc(running), 2, why="test")
    InferenceService.objects.filter(pk=running.pk).update(replicas=1)  # rank 1 is now surplus
    result = rounds.rebuild_round()
    assert set(result.stopped) == {asleep.pk, running.pk}
    assert slots(asleep) == [(0, "cancelled"), (1, "stopped")]
    assert slots(running) == [(0, "running"), (1, "cancelled")]


def test_one_service_failing_its_round_does_not_stop_the_others(world, monkeypatch):
    broken, fine = make_service(world, name="broken"), make_service(world, name="fine")
    node = make_node("rb-8", 8)
    run(broken, 0, node)
    run(fine, 0, node, port=8100)
    real = services.move_service

    def move(service, *args, **kwargs):
        if service.pk == broken.pk:
            raise RuntimeError("boom")
        return real(service, *args, **kwargs)

    monkeypatch.setattr(services, "move_service", move)
    result = rounds.rebuild_round()
    assert result.failed == [broken.pk] and result.moved == {fine.pk: "healthy"}
    assert svc(fine).state == "running" and svc(broken).state == "starting"


# --- the AutoScaler ------------------------------------------------------------------------


def signal(service, *, inflight=None, tokens=None, at=None):
    at = at or utcnow()
    with load_readings.client() as redis:
        if inflight is not None:
            redis.set(load_readings.inflight_key(service.pk), inflight)
        if tokens is not None:
            redis.set(load_readings.tokens_key(service.pk, int(at.timestamp()) // 60 - 1), tokens)


def scalable(world, **autoscaling):
    service = make_service(world, min_replicas=1, max_replicas=4, autoscaling=autoscaling)
    run(service, 0, make_node(f"as-{service.pk}", 8, ip="10.1.0.1"))
    return set_state(service, "running")


def test_in_flight_requests_scale_up_and_the_decision_is_recorded(world):
    service = scalable(world, target_in_flight=4)
    signal(service, inflight=10)
    result = rounds.autoscale_round()
    assert result.scaled == [(service.pk, 1, 3)]
    assert svc(service).replicas == 3 and slots(service) == [(0, "running"), (1, "pending"), (2, "pending")]
    decision = ServiceDecision.objects.filter(service_id=service.pk, source="autoscaler").get()
    assert (decision.action, decision.from_replicas, decision.to_replicas) == ("scale_up", 1, 3)
    assert "in flight 10 over 1 replicas" in decision.reason and decision.details["sample"]["in_flight"] == 10


def test_absent_signals_hold_and_the_same_hold_is_recorded_once(world):
    service = scalable(world, target_in_flight=4)
    start = utcnow()
    with time_machine.travel(start, tick=False) as clock:
        for _ in range(4):
            assert rounds.autoscale_round().decisions[service.pk].direction == "hold"
            clock.shift(30)
    holds = ServiceDecision.objects.filter(service_id=service.pk, source="autoscaler")
    assert holds.count() == 1 and "no reading of in_flight" in holds.get().reason
    assert svc(service).replicas == 1


def test_a_steady_count_records_nothing(world):
    service = scalable(world, target_in_flight=4)
    signal(service, inflight=3)
    for _ in range(2):
        assert "steady at 1" in rounds.autoscale_round().decisions[service.pk].reason
    assert decisions(service, "autoscaler") == []


def test_tokens_and_gpu_utilisation_are_signals(world):
    service = scalable(world, target_tokens_per_s=10, target_in_flight=None)
    signal(service, tokens=60 * 25)  # 25 tokens/s in the last whole minute
    rounds.autoscale_round()
    assert svc(service).replicas == 3

    other = scalable(world, target_gpu_utilisation=50, target_in_flight=None)
    task = task_of(other, 0)
    node = task.node
    for index in (0, 1):
        GpuAllocation.objects.create(task=task, node=node, gpu_index=index, tenant=world.tenants["acme"])
    Gpu.objects.filter(node=node, index__in=[0, 1]).update(utilization=90)
    Gpu.objects.filter(node=node, index=2).update(utilization=0)  # not the replica's card
    decision = rounds.autoscale_round().decisions[other.pk]
    assert decision.desired == 2 and decision.signals["signal"] == "gpu_utilisation"


def test_a_window_holding_the_count_is_skipped(world):
    service = scalable(world, target_in_flight=4)
    InferenceService.objects.filter(pk=service.pk).update(window_action="scale", window_remembered=1)
    signal(service, inflight=40)
    assert rounds.autoscale_round().decisions[service.pk].direction == "skip"
    assert svc(service).replicas == 1 and decisions(service, "autoscaler") == []


# --- sleep and wake ------------------------------------------------------------------------


def test_an_idle_service_sleeps_and_the_wake_task_wakes_it(world):
    service = make_service(world, sleep_after_seconds=600)
    node = make_node("sl-1", 8)
    run(service, 0, node)
    run(service, 1, node)
    set_state(service, "running", state_changed_at=utcnow() - timedelta(seconds=700))
    rounds.autoscale_round()  # no in-flight reading: stays awake
    assert svc(service).state == "running"
    signal(service, inflight=0)
    assert rounds.autoscale_round().slept == [service.pk]
    assert svc(service).state == "sleeping" and slots(service) == [(0, "stopping"), (1, "stopping")]
    Task.objects.filter(group_id=service.pk).update(status=S.STOPPED)  # the agent confirms
    assert not GpuAllocation.objects.filter(task__group_id=service.pk).exists()

    assert jobs.wake_service_job(service.pk) == "woken"
    assert svc(service).state == "waking" and slots(service) == [(0, "pending"), (1, "pending")]
    assert jobs.wake_service_job(service.pk) == "awake"
    run(service, 0, node)
    rounds.rebuild_round()
    assert svc(service).state == "running"
    assert [a for _, a in decisions(service) if a in ("idle", "wake", "healthy")] == ["idle", "wake", "healthy"]
    assert jobs.wake_service_job(10**9) == "gone"


def test_a_wake_of_a_paused_service_is_refused_by_the_task(world):
    service = set_state(make_service(world), "paused")
    assert jobs.wake_service_job(service.pk) == "invalid_state"
    assert svc(service).state == "paused"


def test_a_wake_that_times_out_goes_back_to_sleep_with_an_alert(world):
    service = make_service(world, sleep_after_seconds=600)
    set_state(service, "waking", state_changed_at=utcnow() - timedelta(seconds=601))
    assert rounds.autoscale_round().wake_timed_out == [service.pk]
    assert svc(service).state == "sleeping"
    assert slots(service) == [(0, "cancelled"), (1, "cancelled")]
    alert = Alert.objects.get(key__startswith=f"inference-wake-timed-out:{service.pk}:")
    assert alert.task_id == task_of(service, 0).pk and "did not wake" in alert.message


# --- windows -------------------------------------------------------------------------------

NOON = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)  # a Tuesday
WINDOW = {
    "days": ["mon", "tue", "wed", "thu", "fri"],
    "ranges": [{"start": "09:00", "end": "10:00"}],
    "timezone": "UTC",
}


def test_outside_the_window_pause_and_back_inside_the_count_is_restored(world):
    with time_machine.travel(NOON, tick=False) as clock:
        service = make_service(world, window={**WINDOW, "action": "pause"})
        run(service, 0, make_node("wn-1", 8))
        set_state(service, "running")
        assert rounds.windows_round().applied == [(service.pk, "apply")]
        paused = svc(service)
        assert (paused.state, paused.replicas, paused.window_action, paused.window_remembered) == (
            "paused",
            0,
            "pause",
            2,
        )
        assert slots(service) == [(0, "stopping"), (1, "cancelled")]
        assert rounds.windows_round().applied == []  # held: nothing more
        Task.objects.filter(group_id=service.pk, rank=0).update(status=S.STOPPED)
        clock.move_to(NOON + timedelta(hours=21, minutes=30))  # Wednesday 09:30
        assert rounds.windows_round().applied == [(service.pk, "restore")]
        back = svc(service)
        assert (back.state, back.replicas, back.window_action, back.window_remembered) == ("starting", 2, "", None)
        assert slots(service) == [(0, "pending"), (1, "pending")]


def test_a_scale_window_adds_nothing_for_an_inactive_tenant_and_says_so_once(world):
    with time_machine.travel(NOON, tick=False):
        service = make_service(
            world, min_replicas=1, max_replicas=4, window={**WINDOW, "action": "scale", "scale_to": 3}
        )
        set_state(service, "running")
        set_quota(world, max_gpus=0)
        for _ in range(2):
            assert rounds.windows_round().skipped == [service.pk]
        assert svc(service).replicas == 1 and decisions(service, "window") == [("window", "skip")]
        set_quota(world, max_gpus=None)
        assert rounds.windows_round().applied == [(service.pk, "apply")]
        scaled = svc(service)
        assert (scaled.replicas, scaled.window_action, scaled.window_remembered) == (3, "scale", 1)
        assert len(slots(service)) == 3


def test_a_stop_window_stops_the_service_for_good(world):
    with time_machine.travel(NOON, tick=False) as clock:
        service = make_service(world, window={**WINDOW, "action": "stop"})
        rounds.windows_round()
        assert svc(service).state == "stopping" and svc(service).window_action == "stop"
        clock.move_to(NOON + timedelta(hours=21, minutes=30))
        rounds.windows_round()
        released = svc(service)
        assert released.state == "stopping" and released.window_action == ""
