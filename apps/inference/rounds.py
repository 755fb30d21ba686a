"""The inference services' periodic rounds (declared in apps/inference/jobs.py, each run
under the guard): each loads the state of every service it looks at in a few bulk
queries (never one per replica), asks the pure module for the decision, and applies it
through apps.inference.services (every task move by CAS there).

- `rebuild_round` (10 s): the service's state from its replicas' health (starting →
  running once one is healthy, running → starting when none is, waking → running, stopping
  → stopped once every replica has ended), then rebuild.plan over each starting or running
  service's slots: died replicas requeued (after the crash-loop back-off), those of a dead
  node taken back to the queue, missing ranks created, the crash-loop alert raised (and
  recovered once the slot is healthy);
- `autoscale_round` (30 s): the gateway's signals (Redis, apps.inference.load_readings) and the
  replicas' GPU utilisation from their nodes' heartbeats make a sample, kept with the
  last ones; autoscale.decide on them, applied with scale_service; and the sleep checks
  (sleep.decide_idle, decide_wake_timeout);
- `windows_round` (60 s): windows.decide, applied with apply_window.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Q
from rest_framework.exceptions import ValidationError

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertState
from apps.alerts.models import Alert
from apps.alerts.services import recover_alert
from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.inference import autoscale, load_readings, rebuild, services, sleep, windows
from apps.inference.choices import ServiceStatus
from apps.inference.models import InferenceService, ServiceDecision
from apps.inference.selectors import replica_rows
from apps.nodes import liveness
from apps.tasks.choices import TERMINAL
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import TaskEvent
from apps.tenants.models import Tenant

logger = logging.getLogger(__name__)

REBUILD_POLICY = rebuild.RebuildPolicy()

# --- reading a replica and its node ----------------------------------------------------------

WAITING = (S.PENDING, S.PREEMPTING, S.STOPPING, S.DRAINING)  # the queue has it, or it is ending


def node_health(row: dict, now: datetime) -> sleep.NodeHealth:
    """What this round can say of a replica's node: dead (given up by the liveness rule),
    unknown (silent past the suspect threshold, not given up yet: cannot be read this
    round), alive."""
    if row["node_id"] is None:
        return sleep.NodeHealth.ALIVE
    last = row["node_last_heartbeat_at"]
    if liveness.given_up(last, now):
        return sleep.NodeHealth.DEAD
    if last is None or now >= liveness.suspect_from(last):
        return sleep.NodeHealth.UNKNOWN
    return sleep.NodeHealth.ALIVE


def replica_health(row: dict) -> rebuild.ReplicaHealth:
    status = row["status"]
    if status in TERMINAL:
        return rebuild.ReplicaHealth.DIED
    if status in WAITING:
        return rebuild.ReplicaHealth.PENDING
    if status == S.RUNNING and row["healthy"]:
        return rebuild.ReplicaHealth.HEALTHY
    return rebuild.ReplicaHealth.STARTING


def crash_restarts(task_ids, since: datetime) -> dict[int, tuple[datetime, ...]]:
    """task id -> when its slot was rebuilt after a crash since `since` (its
    replica_requeued events marked so), for every slot in one query."""
    found: dict[int, list[datetime]] = {}
    events = TaskEvent.objects.filter(
        task_id__in=list(task_ids),
        kind="replica_requeued",
        created_at__gt=since,
        **{f"details__{services.CRASH_RESTART}": True},
    ).values_list("task_id", "created_at")
    for task_id, at in events:
        found.setdefault(task_id, []).append(at)
    return {task_id: tuple(sorted(ats)) for task_id, ats in found.items()}


def open_crash_alerts(task_ids) -> set[int]:
    keys = {alert_keys.inference_crash_loop(pk): pk for pk in task_ids}
    if not keys:
        return set()
    active = Alert.objects.filter(key__in=list(keys), state=AlertState.ACTIVE).values_list("key", flat=True)
    return {keys[key] for key in active}


# --- rebuild (10 s) ------------------------------------------------------------------------------

REBUILT_OR_FOLLOWED = (
    ServiceStatus.STARTING,
    ServiceStatus.RUNNING,
    ServiceStatus.WAKING,
    ServiceStatus.STOPPING,
    ServiceStatus.SLEEPING,
    ServiceStatus.PAUSED,
)
# states in which no replica should be queued or run (their replicas were stopped)
AT_REST = (ServiceStatus.SLEEPING, ServiceStatus.PAUSED, ServiceStatus.STOPPING)
LIVE = (S.PENDING, S.SCHEDULED, S.STARTING, S.RUNNING)


@dataclass
class RebuildResult:
    moved: dict[int, str] = field(default_factory=dict)  # service id -> the event it took
    rebuilt: list[tuple[int, int, str]] = field(default_factory=list)  # (service id, rank, action)
    backing_off: list[tuple[int, int]] = field(default_factory=list)
    alerts: list[int] = field(default_factory=list)  # task ids alerted as crash-looping
    recovered: list[int] = field(default_factory=list)
    refused: list[tuple[int, int, str]] = field(default_factory=list)  # the quota had no room
    stopped: dict[int, list[int]] = field(default_factory=dict)  # service id -> stray replicas stopped
    failed: list[int] = field(default_factory=list)  # services whose round raised (logged)


def state_event(state: str, rows: list[dict]) -> sleep.Event | None:
    """The move the replicas' health asks of the service's state, if any."""
    healthy = any(row["status"] == S.RUNNING and row["healthy"] for row in rows)
    if state in (ServiceStatus.STARTING, ServiceStatus.WAKING) and healthy:
        return sleep.Event.HEALTHY
    if state == ServiceStatus.RUNNING and not healthy:
        return sleep.Event.UNHEALTHY
    if state == ServiceStatus.STOPPING and all(row["status"] in TERMINAL for row in rows):
        return sleep.Event.ENDED
    return None


def rebuild_round(now: datetime | None = None) -> RebuildResult:
    now = now or utcnow()
    result = RebuildResult()
    found = list(InferenceService.objects.filter(state__in=REBUILT_OR_FOLLOWED).select_related("group", "model"))
    rows = replica_rows([service.pk for service in found])
    task_ids = [row["task_id"] for service_rows in rows.values() for row in service_rows]
    history = crash_restarts(task_ids, now - timedelta(seconds=REBUILD_POLICY.crash_window_s))
    alerted = open_crash_alerts(task_ids)
    for service in found:
        actions = _slots_and_plan(service, rows[service.pk], history, alerted, now)
        result.backing_off += [(service.pk, a.rank) for a in actions if a.kind == rebuild.RebuildKind.BACK_OFF]
        if _has_work(service, rows[service.pk], actions, alerted):
            _isolated(service, result, _follow, service, rows[service.pk], history, alerted, now, result)
    return result


def _surplus_from(service) -> int:
    """Replicas of this rank and above should not be queued or running."""
    return 0 if service.state in AT_REST else service.replicas


def _strays(service, service_rows) -> bool:
    """A replica queued or running where none should (a stray requeue after a stop, a
    scale-down or a sleep raced with it)."""
    if service.state not in (*AT_REST, *rebuild.REBUILT_STATES):
        return False
    low = _surplus_from(service)
    return any(row["status"] in LIVE and row["rank"] >= low for row in service_rows)


def _slots_and_plan(service, service_rows, history, alerted, now) -> list[rebuild.RebuildAction]:
    slots = [
        rebuild.ReplicaSlot(
            rank=row["rank"],
            health=replica_health(row),
            node=node_health(row, now),
            node_id=row["node_id"],
            died_at=row["finished_at"],
            restarts=history.get(row["task_id"], ()),
            alert_open=row["task_id"] in alerted,
        )
        for row in service_rows
    ]
    return rebuild.plan(sleep.ServiceState(service.state), service.replicas, slots, REBUILD_POLICY, now)


REBUILDING = (rebuild.RebuildKind.RECREATE, rebuild.RebuildKind.RECREATE_ELSEWHERE, rebuild.RebuildKind.CREATE)


def _has_work(service, service_rows, actions, alerted) -> bool:
    """Whether this round changes anything for the service, given its plan (most rounds
    change nothing for most services: those are not given a savepoint)."""
    if state_event(service.state, service_rows) is not None or _strays(service, service_rows):
        return True
    if any(row["task_id"] in alerted and replica_health(row) == rebuild.ReplicaHealth.HEALTHY for row in service_rows):
        return True
    return any(action.kind in REBUILDING or action.alert for action in actions)


STATE_REASONS = {
    sleep.Event.HEALTHY: "a replica is healthy",
    sleep.Event.UNHEALTHY: "no replica is healthy any more",
    sleep.Event.ENDED: "every replica has ended",
}


def _follow(service, service_rows, history, alerted, now, result: RebuildResult) -> None:
    event = state_event(service.state, service_rows)
    if event is not None:
        if services.move_service(service, event, source="rebuild", reason=STATE_REASONS[event]):
            result.moved[service.pk] = str(event)
    if _strays(service, service_rows):
        result.stopped[service.pk] = services.stop_slots(service, from_rank=_surplus_from(service))
    if service.state in rebuild.REBUILT_STATES:
        _rebuild(service, service_rows, history, alerted, now, result)


def _rebuild(service, service_rows, history, alerted, now, result: RebuildResult) -> None:
    by_rank = {row["rank"]: row for row in service_rows}
    for action in _slots_and_plan(service, service_rows, history, alerted, now):
        row = by_rank.get(action.rank)
        if row and row["task_id"] in alerted and replica_health(row) == rebuild.ReplicaHealth.HEALTHY:
            if recover_alert(alert_keys.inference_crash_loop(row["task_id"])):
                result.recovered.append(row["task_id"])
        if action.alert and row:
            if services.alert_crash_loop(service, row["task_id"], row["node_id"], action.reason):
                result.alerts.append(row["task_id"])
        if action.kind not in REBUILDING:
            continue
        try:
            done = services.rebuild_slot(
                service,
                action,
                row["task_id"] if row else None,
                row["status"] if row else None,
                node_id=row["node_id"] if row else None,
            )
        except Conflict as exc:  # the quota has no room now: tried again next round
            result.refused.append((service.pk, action.rank, str(exc.detail)))
            continue
        if done:
            result.rebuilt.append((service.pk, action.rank, str(action.kind)))


# --- the AutoScaler (30 s) and the sleep checks --------------------------------------------------

SCALED = (ServiceStatus.STARTING, ServiceStatus.RUNNING)
SLEEP_CHECKED = (ServiceStatus.RUNNING, ServiceStatus.WAKING)


@dataclass
class AutoscaleResult:
    decisions: dict[int, autoscale.ScaleDecision] = field(default_factory=dict)
    scaled: list[tuple[int, int, int]] = field(default_factory=list)  # (service id, from, to)
    recorded: list[int] = field(default_factory=list)  # services whose decision was recorded
    slept: list[int] = field(default_factory=list)
    wake_timed_out: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # services whose round raised (logged)


def gpu_utilisation(healthy_task_ids: set[int], now: datetime) -> dict[int, float]:
    """task id -> the mean utilisation of the cards it holds (the scheduler's ledger), as
    its node's latest heartbeat reported them, for every task in one query. A card
    without a reading, or a node given up, gives none."""
    if not healthy_task_ids:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT a.task_id, AVG(g.utilization) FROM gpu_allocations a
               JOIN gpus g ON g.node_id = a.node_id AND g.index = a.gpu_index
               JOIN nodes n ON n.id = a.node_id
               WHERE a.task_id = ANY(%s) AND g.utilization IS NOT NULL AND n.last_heartbeat_at >= %s
               GROUP BY a.task_id""",
            [sorted(healthy_task_ids), liveness.heard_since(now)],
        )
        return {task_id: float(mean) for task_id, mean in cursor.fetchall()}


def worth_recording(decision: autoscale.ScaleDecision) -> bool:
    """A change always; a hold only when it says why a change did not happen (a cooldown,
    the max, missing data, the in-flight floor), not a steady count or a skip."""
    if decision.changes:
        return True
    if decision.direction != autoscale.Direction.HOLD:
        return False
    quiet = ("steady at", ": at min ", "not sustained over")
    return not any(words in decision.reason for words in quiet)


def reason_kind(reason: str) -> str:
    """A reason with its figures blanked: two holds of one kind are one record."""
    return re.sub(r"\d+(?:\.\d+)?", "#", reason)


def last_decisions(service_ids, source: str) -> dict[int, ServiceDecision]:
    """service id -> its latest decision from `source`, for every service in one query."""
    if not service_ids:
        return {}
    latest = (
        ServiceDecision.objects.filter(service_id__in=list(service_ids), source=source)
        .order_by("service_id", "-created_at", "-id")
        .distinct("service_id")
    )
    return {decision.service_id: decision for decision in latest}


def autoscale_round(now: datetime | None = None) -> AutoscaleResult:
    now = now or utcnow()
    result = AutoscaleResult()
    found = list(InferenceService.objects.filter(state__in=(*SCALED, *SLEEP_CHECKED)).select_related("group"))
    if not found:
        return result
    ids = [service.pk for service in found]
    rows = replica_rows(ids)
    readings = load_readings.read(ids, now)
    healthy_ids = {row["task_id"] for service_rows in rows.values() for row in service_rows if row["healthy"]}
    utilisation = gpu_utilisation(healthy_ids, now)
    last = last_decisions(ids, "autoscaler")
    awake = []
    for service in found:
        reading = readings.get(service.pk, load_readings.Reading())
        move = _sleep_verdict(service, reading, now) if service.state in SLEEP_CHECKED else None
        if move is not None and _isolated(service, result, _sleep, service, *move, result):
            continue  # it went to sleep, or back to sleep
        if service.state in SCALED:
            awake.append(service)
    samples = {}
    for service in awake:
        cards = [utilisation[row["task_id"]] for row in rows[service.pk] if row["task_id"] in utilisation]
        reading = readings.get(service.pk, load_readings.Reading())
        samples[service.pk] = autoscale.Sample(
            at=now,
            in_flight=reading.in_flight,
            tokens_per_s=reading.tokens_per_s,
            gpu_utilisation=sum(cards) / len(cards) if cards else None,
        )
    series = load_readings.remember_all(samples, now)
    for service in awake:
        decision = _decision(service, rows[service.pk], series.get(service.pk, [samples[service.pk]]), now)
        if decision is None:
            continue
        result.decisions[service.pk] = decision
        if decision.changes or worth_recording(decision):
            _isolated(service, result, _apply_scale, service, decision, samples[service.pk], last, result)
    return result


def _isolated(service, result, work, *args):
    """work(*args) in its own savepoint: one service's trouble (logged) does not undo the
    round for the others."""
    try:
        with transaction.atomic():
            return work(*args)
    except Exception:
        logger.exception("inference round for service %s failed", service.pk)
        result.failed.append(service.pk)
        return None


def _decision(service, service_rows, series, now) -> autoscale.ScaleDecision | None:
    try:
        policy = services.scaling_policy(service)
    except autoscale.PolicyError as exc:  # written past the API
        logger.warning("inference service %s: its autoscaling policy is unreadable: %s", service.pk, exc)
        return None
    counted = [row for row in service_rows if row["rank"] < service.replicas]
    state = autoscale.ScalingState(
        replicas=service.replicas,
        healthy=sum(1 for row in counted if row["healthy"]),
        starting=sum(1 for row in counted if row["status"] not in TERMINAL and not row["healthy"]),
        last_change_at=service.last_scaled_at,
        last_direction=autoscale.Direction(service.last_scale_direction) if service.last_scale_direction else None,
        sleeping=service.state == ServiceStatus.SLEEPING,
        window_holds=bool(service.window_action),
    )
    return autoscale.decide(policy, state, series, now)


def _apply_scale(service, decision, sample, last, result: AutoscaleResult) -> None:
    details = {"signals": _jsonable(decision.signals), "sample": _sample_details(sample)}
    if not decision.changes:
        _record_hold(service, decision.reason, details, last, result)
        return
    try:
        scaled = services.scale_service(
            service, decision.desired, source="autoscaler", reason=decision.reason, details=details
        )
    except Conflict as exc:  # the quota has no room for more: held, said once
        _record_hold(service, f"{decision.reason}, but {exc.detail}", details, last, result)
        return
    if scaled:
        result.scaled.append((service.pk, decision.current, decision.desired))
        result.recorded.append(service.pk)


def _record_hold(service, reason: str, details: dict, last: dict, result: AutoscaleResult) -> None:
    previous = last.get(service.pk)
    if previous and previous.action == "hold" and reason_kind(previous.reason) == reason_kind(reason):
        return  # the same hold as last time: not one row per round
    last[service.pk] = services.record_decision(
        service,
        "autoscaler",
        "hold",
        reason,
        from_replicas=service.replicas,
        to_replicas=service.replicas,
        details=details,
    )
    result.recorded.append(service.pk)


def _sleep_verdict(service, reading: load_readings.Reading, now: datetime) -> tuple[sleep.Event, str] | None:
    """Sleep for an idle running service; back to sleep for a waking one whose wake has
    timed out; None: neither."""
    policy = services.sleep_policy(service)
    if service.state == ServiceStatus.WAKING:
        verdict = sleep.decide_wake_timeout(
            policy, sleep.ServiceState.WAKING, waking_since=service.state_changed_at, now=now
        )
        return (sleep.Event.WAKE_TIMED_OUT, verdict.reason) if verdict.yes else None
    verdict = sleep.decide_idle(
        policy,
        sleep.ServiceState(service.state),
        running_since=service.state_changed_at,
        last_request_at=service.last_request_at,
        in_flight=reading.in_flight,
        now=now,
    )
    return (sleep.Event.IDLE, verdict.reason) if verdict.yes else None


def _sleep(service, event: sleep.Event, reason: str, result: AutoscaleResult) -> bool:
    source = "wake" if event == sleep.Event.WAKE_TIMED_OUT else "sleep"
    if not services.move_service(service, event, source=source, reason=reason):
        return False
    (result.wake_timed_out if event == sleep.Event.WAKE_TIMED_OUT else result.slept).append(service.pk)
    return True


def _sample_details(sample: autoscale.Sample) -> dict:
    return {
        "in_flight": sample.in_flight,
        "tokens_per_s": sample.tokens_per_s,
        "gpu_utilisation": sample.gpu_utilisation,
    }


def _jsonable(values: dict) -> dict:
    return {
        key: value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
        for key, value in values.items()
    }


# --- scheduling windows (60 s) -------------------------------------------------------------------


@dataclass
class WindowsResult:
    decisions: dict[int, windows.WindowDecision] = field(default_factory=dict)
    applied: list[tuple[int, str]] = field(default_factory=list)  # (service id, move)
    skipped: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # services whose round raised (logged)


def inactive_tenants(tenant_ids) -> set[int]:
    """**Choice** (the platform has no tenant status): a tenant is inactive when its quota
    lets it run nothing (max_gpus or max_concurrent_tasks 0)."""
    return set(
        Tenant.objects.filter(pk__in=list(tenant_ids))
        .filter(Q(max_gpus=0) | Q(max_concurrent_tasks=0))
        .values_list("pk", flat=True)
    )


def windows_round(now: datetime | None = None) -> WindowsResult:
    now = now or utcnow()
    result = WindowsResult()
    found = list(
        InferenceService.objects.filter(Q(window__isnull=False) | ~Q(window_action=""))
        .exclude(state=ServiceStatus.STOPPED, window_action="")
        .select_related("group")
    )
    inactive = inactive_tenants({service.group.tenant_id for service in found})
    last = last_decisions([service.pk for service in found], "window")
    for service in found:
        try:
            window = windows.parse_window(service.window) if service.window is not None else None
        except windows.WindowError as exc:  # written past the API
            logger.warning("inference service %s: its window is unreadable: %s", service.pk, exc)
            continue
        state = windows.WindowState(
            replicas=service.replicas,
            held_action=windows.WindowAction(service.window_action) if service.window_action else None,
            remembered=service.window_remembered,
            tenant_active=service.group.tenant_id not in inactive,
            stopped=service.state in (ServiceStatus.STOPPING, ServiceStatus.STOPPED),
            sleeping=service.state == ServiceStatus.SLEEPING,
        )
        decision = windows.decide(window, state, now)
        result.decisions[service.pk] = decision
        if decision.move == windows.WindowMove.SKIP:
            result.skipped.append(service.pk)
            previous = last.get(service.pk)
            if not (previous and previous.action == "skip" and previous.reason == decision.reason):
                services.record_decision(service, "window", "skip", decision.reason)
            continue
        if decision.move == windows.WindowMove.NONE:
            continue
        if _isolated(service, result, _apply_window, service, decision):
            result.applied.append((service.pk, str(decision.move)))
    return result


def _apply_window(service, decision: windows.WindowDecision) -> bool:
    try:
        return services.apply_window(service, decision)
    except (Conflict, ValidationError) as exc:  # no quota for the restore, a scale_to above max: next round
        logger.info("inference service %s: window %s refused: %s", service.pk, decision.move, exc.detail)
        return False
