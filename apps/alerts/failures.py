"""The failure policy: the server decides what happens to a task whose node, container or
run went missing; the agent only reports what it sees (docs/failures.md).

Every move goes through apps.tasks.services.move_tasks (a CAS through the state
machine), so two sweeps on two instances, or a sweep and a late agent report, cannot
both move the same task. Work is set-based: one statement finds what changed, and only
the changed rows cost anything more.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertState, AlertType, Severity
from apps.alerts.models import Alert
from apps.alerts.services import NewAlert, raise_alert, raise_alerts, recover_alert
from apps.core.clock import utcnow
from apps.core.models import JobRun
from apps.nodes import liveness
from apps.nodes.choices import NodeStatus
from apps.nodes.models import Node
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task, TaskGroup
from apps.tasks.services import (
    fail_group,
    move_tasks,
    quota_problems,
    quota_use,
    record_event,
    record_events,
    task_event,
)
from apps.tenants.models import Tenant

logger = logging.getLogger(__name__)

# a node's tasks, by status, when the node goes silent
REQUEUED_WHEN_NODE_LOST = (S.RUNNING, S.SCHEDULED, S.STARTING, S.WAKING)
ENDED_WHEN_NODE_LOST = {S.STOPPING: S.STOPPED, S.DRAINING: S.COMPLETED}
# a task the agent no longer has a container (or process) for
LOST_RUN_STATUSES = (S.RUNNING, S.STARTING)


# --- adjudication: requeue, fail, or cannot tell -------------------------------------------


class Verdict(enum.StrEnum):
    REQUEUE = "requeue"  # a node that could run it is alive: back to the queue
    FAIL = "fail"  # nothing alive could run it: waiting would be forever
    UNDECIDED = "undecided"  # the evidence is unclear: change nothing, ask again next round


# The nodes the failure policy counts on (liveness.heard_since) with enough cards of the
# type for the task.
CAPACITY_SQL = f"""
    SELECT n.status, n.executable
    FROM nodes AS n
    WHERE {liveness.heard_from_sql("n.last_heartbeat_at", "%(cutoff)s")} AND n.status <> 'offline'
      AND (SELECT count(*) FROM gpus AS g
           WHERE g.node_id = n.id AND g.lost_at IS NULL AND (%(gpu_type)s = '' OR g.vendor = %(gpu_type)s)
          ) >= %(gpus)s
"""


def capacity_verdict(*, gpus: int, gpu_type: str = "", now=None) -> Verdict:
    """Whether live capacity exists for a task of `gpus` cards (of `gpu_type`). Any
    database error is UNDECIDED: fail closed, never fail a task on a hiccup."""
    cutoff = liveness.heard_since(now or utcnow())
    try:
        # a savepoint, so that a failed check leaves the caller's transaction usable
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(CAPACITY_SQL, {"cutoff": cutoff, "gpu_type": gpu_type or "", "gpus": gpus})
            candidates = cursor.fetchall()
    except Exception as exc:  # noqa: BLE001 — any failure to tell is "cannot tell"
        logger.warning("capacity check failed, deciding nothing this round: %s", exc)
        return Verdict.UNDECIDED
    if any(status == NodeStatus.ONLINE and executable for status, executable in candidates):
        return Verdict.REQUEUE
    # a suspect node may be alive or dead; a degraded one is alive but cannot take work
    if any(status == NodeStatus.SUSPECT and executable for status, executable in candidates):
        return Verdict.UNDECIDED
    return Verdict.FAIL


@dataclass
class LostRun:
    task_id: int
    verdict: Verdict
    moved: bool  # False: the task had already moved on (or the verdict was UNDECIDED)


def adjudicate_lost_runs(task_ids, *, node_id: str, cause: str, detail: str = "", now=None) -> list[LostRun]:
    """Tasks whose run vanished on a node that is still alive (the agent found no
    container; or the node stopped listing them as alive). Each is requeued while
    capacity to run it is alive, failed when none is, and left as it is when that cannot
    be told. Verdicts are shared by tasks of the same size and type."""
    now = now or utcnow()
    tasks = list(
        Task.objects.filter(pk__in=list(task_ids), node_id=node_id, status__in=LOST_RUN_STATUSES).values_list(
            "pk", "status", "gpu_required", "gpu_type", "tenant_id", "name"
        )
    )
    verdicts: dict[tuple[int, str], Verdict] = {}
    outcomes = []
    requeue_alerts = []
    seen = f" (the agent: {detail})" if detail else ""
    for pk, status, gpus, gpu_type, tenant_id, name in tasks:
        verdict = verdicts.setdefault((gpus, gpu_type), capacity_verdict(gpus=gpus, gpu_type=gpu_type, now=now))
        moved = False
        if verdict == Verdict.REQUEUE:
            with transaction.atomic():
                moved = bool(move_tasks(pk, [status], S.PENDING, node=None, host_port=None))
                if moved:
                    _record(
                        pk, f"{cause}_pending", node_id, f"{CAUSES[cause]} on node {node_id}{seen}: back to the queue"
                    )
                    requeue_alerts.append(_requeue_alert(pk, name, tenant_id, node_id, CAUSES[cause]))
        elif verdict == Verdict.FAIL:
            message = f"{CAUSES[cause]} on node {node_id} and no node that could run it is alive"
            with transaction.atomic():
                moved = bool(move_tasks(pk, [status], S.FAILED, error_message=message))
                if moved:
                    _record(pk, f"{cause}_failed", node_id, message + seen)
        else:
            _record(
                pk,
                f"{cause}_undecided",
                node_id,
                f"{CAUSES[cause]} on node {node_id}{seen}; whether a node could run it cannot be told now: "
                "asked again next round",
            )
        outcomes.append(LostRun(pk, verdict, moved))
    raise_alerts(requeue_alerts)
    answered = {outcome.task_id for outcome in outcomes}
    outcomes += [LostRun(pk, Verdict.UNDECIDED, False) for pk in task_ids if pk not in answered]
    return outcomes


CAUSES = {
    "container_lost": "its container vanished",
    "stalled": "its node has not listed it as alive",
}


def _record(task_id: int, kind: str, node_id: str, message: str) -> None:
    record_event(Task(pk=task_id), kind=kind, message=message, node_id=node_id)


def _requeue_alert(pk, name, tenant_id, node_id, why) -> NewAlert:
    # one alert per requeue: the key carries the moment, so a task requeued again later alerts again
    return NewAlert(
        type=AlertType.TASK_REQUEUED,
        severity=Severity.WARNING,
        scope=AlertScope.TASK,
        key=alert_keys.task_requeued(pk, utcnow()),
        message=f"Task {name} ({pk}) was requeued: {why} on node {node_id}.",
        node_id=node_id or "",
        task_id=pk,
        tenant_id=tenant_id,
        details={"cause": why},
    )


# --- the sweep ----------------------------------------------------------------------------


@dataclass
class SweepResult:
    offline: list[str] = field(default_factory=list)  # nodes found silent this pass (alert newly raised)
    recovered: list[str] = field(default_factory=list)
    requeued: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # stopping → stopped, draining → completed
    failed: list[int] = field(default_factory=list)  # no node alive anywhere: nothing to wait for
    stalled: list[LostRun] = field(default_factory=list)
    queue_timed_out: list[int] = field(default_factory=list)
    groups_failed: list[int] = field(default_factory=list)  # requeued whole, and nothing alive could run them
    quota_recovered: list[int] = field(default_factory=list)  # tenants back under their quota
    scheduler_stalled: bool = False
    driver_errors: list[str] = field(default_factory=list)  # nodes whose GPUs cannot be read (alert newly raised)
    driver_recovered: list[str] = field(default_factory=list)


def sweep(now=None) -> SweepResult:
    """The alert sweep (every HETEROFLOW_ALERT_SWEEP_SECONDS, on every instance)."""
    now = now or utcnow()
    result = sweep_offline_nodes(now)
    result.stalled = sweep_stalled_tasks(now)
    result.groups_failed = sweep_requeued_groups(now)
    result.queue_timed_out = fail_overdue_queue(now)
    result.quota_recovered = recover_quota_alerts()
    result.scheduler_stalled = check_scheduler(now)
    result.driver_errors, result.driver_recovered = sweep_gpu_driver_errors(now)
    return result


def sweep_offline_nodes(now=None) -> SweepResult:
    """A node the failure policy gives up (liveness.given_up: silent for longer than
    HETEROFLOW_NODE_OFFLINE_SECONDS, 45 s, whatever its status shows) raises
    NODE_OFFLINE and its tasks are handled by state: running / scheduled / starting /
    waking go back to the queue (cards released, one event and one TASK_REQUEUED each);
    stopping ends as stopped and draining as completed; sleeping and preempting are left
    alone (the preemption watchdog owns the latter). When no node at all is alive, the
    tasks fail instead of waiting for a node that may never come. A node heard from
    again recovers its alert."""
    now = now or utcnow()
    silence = liveness.give_up_seconds()
    cutoff = liveness.heard_since(now)
    result = SweepResult()
    # (a node never heard from, registered by hand, has nothing to lose and raises nothing)
    # only the newly silent: a node already under an active NODE_OFFLINE costs nothing more
    newly_silent = sorted(
        Node.objects.filter(liveness.given_up_q(now))
        .exclude(pk__in=Alert.objects.filter(type=AlertType.NODE_OFFLINE, state=AlertState.ACTIVE).values("node_id"))
        .values_list("pk", flat=True)
    )
    alive = Node.objects.filter(liveness.heard_from_q(now)).values_list("pk", flat=True)
    raised = raise_alerts(
        [
            NewAlert(
                type=AlertType.NODE_OFFLINE,
                severity=Severity.ERROR,
                scope=AlertScope.NODE,
                key=alert_keys.node_offline(node_id),
                node_id=node_id,
                message=f"Node {node_id} has not sent a heartbeat for more than {silence} s.",
            )
            for node_id in newly_silent
        ]
    )
    result.offline = [node_id for node_id in newly_silent if alert_keys.node_offline(node_id) in raised]
    result.recovered = recover_node_alerts(
        AlertType.NODE_OFFLINE, liveness.heard_from_sql("n.last_heartbeat_at"), [cutoff], now
    )
    # every silent node's tasks, not only the newly silent's: a move that lost a race
    # last time is tried again
    stranded = list(
        Task.objects.filter(
            liveness.given_up_q(now, "node__last_heartbeat_at"),
            status__in=(*REQUEUED_WHEN_NODE_LOST, *ENDED_WHEN_NODE_LOST),
        ).values_list("pk", "status", "node_id", "name", "tenant_id")
    )
    if not stranded:
        return result
    nobody_alive = not alive.exists()
    by_move: dict[tuple[str, str], list] = {}
    for row in stranded:
        status = row[1]
        target = ENDED_WHEN_NODE_LOST.get(status) or (S.FAILED if nobody_alive else S.PENDING)
        by_move.setdefault((status, target), []).append(row)
    for (source, target), rows in sorted(by_move.items()):
        changes = {"node": None, "host_port": None} if target == S.PENDING else {}
        if target == S.FAILED:
            changes["error_message"] = "its node went silent and no node in the cluster is alive"
        with transaction.atomic():
            moved = set(move_tasks([row[0] for row in rows], [source], target, **changes))
            won = [row for row in rows if row[0] in moved]
            record_events(
                task_event(
                    pk,
                    kind=f"node_lost_{target}",
                    node_id=node_id,
                    message=f"node {node_id} silent for more than {silence} s: {target}",
                )
                for pk, _, node_id, _, _ in won
            )
            if target == S.PENDING:
                raise_alerts(
                    [
                        _requeue_alert(pk, name, tenant_id, node_id, f"its node was silent for more than {silence} s")
                        for pk, _, node_id, name, tenant_id in won
                    ]
                )
        bucket = result.failed if target == S.FAILED else (result.requeued if target == S.PENDING else result.finished)
        bucket.extend(sorted(moved))
    return result


def recover_node_alerts(alert_type: str, condition_sql: str, params: list, now) -> list[str]:
    """The active node alerts of a type whose node (`n`) now meets `condition_sql`
    (its %s taking `params`) move to RECOVERED; their node ids."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""UPDATE alerts AS a SET state = %s, ended_at = %s, updated_at = %s
               FROM nodes AS n
               WHERE a.type = %s AND a.state = %s AND n.id = a.node_id AND {condition_sql}
               RETURNING a.node_id""",
            [AlertState.RECOVERED, now, now, alert_type, AlertState.ACTIVE, *params],
        )
        return sorted(node_id for (node_id,) in cursor.fetchall())


def sweep_gpu_driver_errors(now=None) -> tuple[list[str], list[str]]:
    """A node heard from whose GPU collector fails as a whole (`gpu_collector_error`: the
    driver or the vendor tool; its beats make it degraded, so it takes no work) raises
    GPU_DRIVER_ERROR; the alert recovers once its GPUs read again. Found by a partial
    index of the failing nodes. (newly raised, recovered)"""
    now = now or utcnow()
    alerted = Alert.objects.filter(type=AlertType.GPU_DRIVER_ERROR, state=AlertState.ACTIVE).values("node_id")
    failing = list(
        Node.objects.filter(liveness.heard_from_q(now))
        .exclude(gpu_collector_error="")
        .exclude(pk__in=alerted)
        .order_by("pk")
        .values_list("pk", "gpu_collector_error")
    )
    raised = raise_alerts(
        [
            NewAlert(
                type=AlertType.GPU_DRIVER_ERROR,
                severity=Severity.ERROR,
                scope=AlertScope.NODE,
                key=alert_keys.gpu_driver_error(node_id),
                node_id=node_id,
                message=f"The GPUs of node {node_id} cannot be read ({error[:300]}): it is degraded and takes no "
                "work until they can.",
                details={"error": error},
            )
            for node_id, error in failing
        ]
    )
    recovered = recover_node_alerts(AlertType.GPU_DRIVER_ERROR, "n.gpu_collector_error = ''", [], now)
    return [node_id for node_id, _ in failing if alert_keys.gpu_driver_error(node_id) in raised], recovered


def sweep_stalled_tasks(now=None) -> list[LostRun]:
    """A running task that its node, alive and reporting live tasks, has not listed for
    HETEROFLOW_STALLED_TASK_SECONDS is adjudicated like a vanished container. A node
    that does not report live tasks (no executor) is never judged this way."""
    now = now or utcnow()
    cutoff = liveness.heard_since(now)
    with connection.cursor() as cursor:
        # listed again (or no longer running there): the clock stops
        cursor.execute(
            """UPDATE tasks AS t SET missing_since = NULL
               FROM nodes AS n
               WHERE t.missing_since IS NOT NULL AND n.id = t.node_id
                 AND (t.status <> 'running' OR n.live_task_ids IS NULL OR n.live_task_ids @> to_jsonb(t.id))"""
        )
        # absent from a beat sent after it started running: the clock starts
        cursor.execute(
            f"""UPDATE tasks AS t SET missing_since = %(now)s
               FROM nodes AS n
               WHERE t.status = 'running' AND t.missing_since IS NULL AND n.id = t.node_id
                 AND {liveness.heard_from_sql("n.last_heartbeat_at", "%(cutoff)s")}
                 AND n.last_heartbeat_at > t.updated_at
                 AND n.live_task_ids IS NOT NULL AND NOT n.live_task_ids @> to_jsonb(t.id)""",
            {"now": now, "cutoff": cutoff},
        )
    overdue = now - timedelta(seconds=settings.HETEROFLOW_STALLED_TASK_SECONDS)
    stalled: dict[str, list[int]] = {}
    for pk, node_id in Task.objects.filter(status=S.RUNNING, missing_since__lte=overdue).values_list("pk", "node_id"):
        stalled.setdefault(node_id, []).append(pk)
    outcomes = []
    for node_id, task_ids in sorted(stalled.items()):
        outcomes += adjudicate_lost_runs(task_ids, node_id=node_id, cause="stalled", now=now)
    return outcomes


# Gang groups requeued whole (a lost worker ended their attempt, apps.tasks.services) and
# waiting in the queue, every member pending; found through the pending members' index.
# (A replica of an inference service is a single task here: the service's rebuild owns it.)
REQUEUED_GROUPS_SQL = """
    SELECT g.id, g.gpus_per_worker, g.gpu_type FROM task_groups AS g
    WHERE g.placement = 'gang'
      AND g.id IN (SELECT group_id FROM tasks WHERE status = 'pending' AND group_id IS NOT NULL)
      AND g.attempts > 0 AND g.ended_attempt = g.attempts
      AND NOT EXISTS (SELECT 1 FROM tasks AS t WHERE t.group_id = g.id AND t.status <> 'pending')
    ORDER BY g.id
"""


def sweep_requeued_groups(now=None) -> list[int]:
    """A task group requeued whole fails whole when no live node could run one of its
    workers: the verdict a single task of `gpus_per_worker` cards of the group's type
    gets (capacity_verdict). While capacity is alive, or that cannot be told, it waits
    for the scheduler. Returns the groups failed."""
    now = now or utcnow()
    with connection.cursor() as cursor:
        cursor.execute(REQUEUED_GROUPS_SQL)
        rows = cursor.fetchall()
    verdicts: dict[tuple[int, str], Verdict] = {}
    failed = []
    for group_id, gpus, gpu_type in rows:
        verdict = verdicts.setdefault((gpus, gpu_type), capacity_verdict(gpus=gpus, gpu_type=gpu_type, now=now))
        if verdict != Verdict.FAIL:
            continue
        with transaction.atomic():
            group = TaskGroup.objects.select_for_update().get(pk=group_id)
            still_waiting = group.ended_attempt == group.attempts and not group.tasks.exclude(status=S.PENDING).exists()
            reason = f"no live node could run one of its workers ({gpus} {gpu_type or 'any'} cards)"
            if still_waiting and fail_group(group, f"requeued after attempt {group.attempts}, and {reason}"):
                failed.append(group_id)
    return failed


def fail_overdue_queue(now=None) -> list[int]:
    """A task queued for longer than HETEROFLOW_QUEUE_TIMEOUT_SECONDS fails. The clock
    starts at the later of its creation and its last change, so a service that ran for
    days and was just requeued is not failed for having been "queued too long"."""
    limit = settings.HETEROFLOW_QUEUE_TIMEOUT_SECONDS
    if not limit:
        return []
    deadline = (now or utcnow()) - timedelta(seconds=limit)
    from django.db.models import F
    from django.db.models.functions import Greatest

    overdue = list(
        Task.objects.filter(status=S.PENDING)
        .annotate(queued_since=Greatest(F("created_at"), F("updated_at")))
        .filter(queued_since__lt=deadline)
        .order_by("pk")
        .values_list("pk", flat=True)[:1000]
    )
    return move_tasks(overdue, [S.PENDING], S.FAILED, error_message=f"waited in the queue for more than {limit} s")


def recover_quota_alerts() -> list[int]:
    """QUOTA_EXCEEDED ends once the tenant could queue a one-GPU task again."""
    recovered = []
    active = Alert.objects.filter(type=AlertType.QUOTA_EXCEEDED, state=AlertState.ACTIVE).values_list(
        "tenant_id", flat=True
    )
    for tenant in Tenant.objects.filter(pk__in=list(active)):
        if not quota_problems(tenant, quota_use(tenant), gpus=1, gpu_memory_mb=0):
            if recover_alert(alert_keys.quota_exceeded(tenant.pk)):
                recovered.append(tenant.pk)
    return recovered


def check_scheduler(now=None) -> bool:
    """SCHEDULER_STALLED while tasks wait and no scheduler cycle finished for
    HETEROFLOW_SCHEDULER_STALLED_SECONDS anywhere in the cluster; recovered by the next
    sweep after a cycle. Returns whether it is stalled."""
    now = now or utcnow()
    limit = timedelta(seconds=settings.HETEROFLOW_SCHEDULER_STALLED_SECONDS)
    run = JobRun.objects.filter(key="scheduler.tick").only("last_finished_at").first()
    last = run.last_finished_at if run else None
    fresh = last is not None and now - last <= limit
    waiting = Task.objects.filter(status=S.PENDING, created_at__lte=now - limit).exists()
    if fresh or not waiting:
        recover_alert(alert_keys.SCHEDULER_STALLED)
        return False
    since = f"since {last:%Y-%m-%d %H:%M:%S} UTC" if last else "ever"
    raise_alert(
        type=AlertType.SCHEDULER_STALLED,
        severity=Severity.CRITICAL,
        scope=AlertScope.CLUSTER,
        key=alert_keys.SCHEDULER_STALLED,
        details={"last_cycle_finished_at": last.isoformat() if last else None},
        message=f"No scheduler cycle has finished {since} while tasks wait in the queue.",
    )
    return True
