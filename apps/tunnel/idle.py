"""Idle interactive tasks are stopped (docs/interactive.md#idle): an interactive task whose
cards have stayed under HETEROFLOW_INTERACTIVE_IDLE_PERCENT of utilisation, with no tunnel
session open or ended, for its `idle_minutes`, is stopped (the graceful stop, as `hf stop`
does), and its owner is warned HETEROFLOW_INTERACTIVE_WARN_MINUTES before: a
INTERACTIVE_IDLE alert (which reaches the tenant's notification channels) and an event in
its history. Work after the warning (a session, a busy card) takes the warning back.

The judgement comes in small steps that the sweep reuses:

- `last_busy`: when the task was last in use, the latest of its start, its cards' last
  sample at or over the threshold (the heartbeat's samples in `node_metrics`, read back
  only as far as its idle time), and its tunnel sessions (an open one is use now);
- `verdict`: from that and the clock, whether to stop it, warn, take a warning back, or
  nothing.

Writes: one task at a time, in id order, each in a transaction of its own: the stop is
the services' CAS move, the warning mark a one-row UPDATE guarded on the status; the alert
rows are the alert store's, one key each. A task's row is never held past its own step,
and a node's rows are never written (docs/architecture.md#lock-order).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from django.conf import settings
from django.db import connection, transaction

from apps.alerts import keys as alert_keys
from apps.alerts import services as alerts
from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.core.clock import utcnow
from apps.tasks import services as tasks
from apps.tasks.choices import TaskKind, TaskStatus
from apps.tasks.models import Task
from apps.tunnel.choices import SessionOutcome
from apps.tunnel.models import TunnelSession

logger = logging.getLogger(__name__)

# The latest sample (no earlier than `since`) in which any of the task's cards was at or
# over the threshold: the node's samples of the window, by (node_id, at).
CARDS_LAST_BUSY = """
    SELECT max(m.at) FROM node_metrics AS m CROSS JOIN LATERAL jsonb_array_elements(m.gpus) AS g
    WHERE m.node_id = %(node)s AND m.at >= %(since)s
      AND (g->>'i')::int = ANY(%(cards)s) AND (g->>'u')::float8 >= %(percent)s
"""
CARDS_OF = "SELECT gpu_index FROM gpu_allocations WHERE task_id = %s"
MARK_WARNED = "UPDATE tasks SET idle_warned_at = %s WHERE id = %s AND status = 'running'"


class Verdict(StrEnum):
    STOP = "stop"
    WARN = "warn"
    IN_USE_AGAIN = "in_use_again"  # warned, then used: the warning is taken back
    NONE = "none"


@dataclass(frozen=True)
class Judged:
    task_id: int
    verdict: Verdict
    last_busy: datetime
    idle_minutes: int


def last_busy(task: Task, now: datetime) -> datetime:
    """When the task was last in use (see the module's words), looking back no further
    than its idle time."""
    since = now - timedelta(minutes=task.idle_minutes)
    busy = [task.started_at or task.created_at]
    sessions = TunnelSession.objects.filter(task_id=task.pk)
    if sessions.filter(outcome=SessionOutcome.OPEN).exists():
        return now
    ended = sessions.filter(ended_at__gte=since).order_by("-ended_at").values_list("ended_at", flat=True).first()
    if ended is not None:
        busy.append(ended)
    with connection.cursor() as cursor:
        cursor.execute(CARDS_OF, [task.pk])
        cards = [index for (index,) in cursor.fetchall()]
        if cards and task.node_id:
            params = {
                "node": task.node_id,
                "since": max(since, busy[0]),
                "cards": cards,
                "percent": settings.HETEROFLOW_INTERACTIVE_IDLE_PERCENT,
            }
            cursor.execute(CARDS_LAST_BUSY, params)
            (sampled,) = cursor.fetchone()
            if sampled is not None:
                busy.append(sampled)
    return max(busy)


def verdict(task: Task, busy: datetime, now: datetime) -> Verdict:
    idle = now - busy
    limit = timedelta(minutes=task.idle_minutes)
    if idle >= limit:
        return Verdict.STOP
    warned = task.idle_warned_at is not None and task.idle_warned_at >= busy
    if idle >= limit - timedelta(minutes=settings.HETEROFLOW_INTERACTIVE_WARN_MINUTES):
        return Verdict.NONE if warned else Verdict.WARN
    if task.idle_warned_at is not None:
        return Verdict.IN_USE_AGAIN
    return Verdict.NONE


def judge(task: Task, now: datetime) -> Judged:
    busy = last_busy(task, now)
    return Judged(task.pk, verdict(task, busy, now), busy, task.idle_minutes)


def idle_words(judged: Judged) -> str:
    return (
        f"no tunnel session and its cards under {settings.HETEROFLOW_INTERACTIVE_IDLE_PERCENT:g} % "
        f"since {judged.last_busy:%Y-%m-%d %H:%M} UTC"
    )


def stop(task: Task, judged: Judged) -> bool:
    if task.pk not in tasks.stop_tasks([task.pk]):
        return False  # it ended meanwhile
    tasks.record_event(
        task,
        kind="idle_stopped",
        message=f"Stopped after {judged.idle_minutes} minutes idle ({idle_words(judged)}).",
        details={"idle_minutes": judged.idle_minutes, "last_busy": judged.last_busy.isoformat()},
    )
    alerts.recover_alert(alert_keys.interactive_idle(task.pk))
    return True


def warn(task: Task, judged: Judged, now: datetime) -> bool:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(MARK_WARNED, [now, task.pk])
        if cursor.rowcount != 1:
            return False
        left = max(1, round((judged.last_busy + timedelta(minutes=judged.idle_minutes) - now).total_seconds() / 60))
        message = (
            f"Interactive task {task.pk} ({task.name}) will be stopped in about {left} minutes for idling: "
            f"{idle_words(judged)}. Open a session or use its cards to keep it."
        )
        tasks.record_event(task, kind="idle_warning", message=message, details={"stops_in_minutes": left})
        alerts.raise_alert(
            type=AlertType.INTERACTIVE_IDLE,
            severity=Severity.WARNING,
            scope=AlertScope.TASK,
            key=alert_keys.interactive_idle(task.pk),
            message=message,
            task_id=task.pk,
            tenant_id=task.tenant_id,
            node_id=task.node_id or "",
            details={"stops_in_minutes": left, "idle_minutes": judged.idle_minutes},
        )
    return True


def in_use_again(task: Task) -> None:
    Task.objects.filter(pk=task.pk).update(idle_warned_at=None)
    alerts.recover_alert(alert_keys.interactive_idle(task.pk))


def sweep(now: datetime | None = None) -> dict:
    """Judge every running interactive task with an idle time, in id order, one at a time."""
    now = now or utcnow()
    counts = {verdict.value: 0 for verdict in Verdict}
    running = Task.objects.filter(
        kind=TaskKind.INTERACTIVE, status=TaskStatus.RUNNING, idle_minutes__isnull=False
    ).order_by("pk")
    for task in running.iterator():
        judged = judge(task, now)
        if judged.verdict == Verdict.STOP:
            done = stop(task, judged)
        elif judged.verdict == Verdict.WARN:
            done = warn(task, judged, now)
        elif judged.verdict == Verdict.IN_USE_AGAIN:
            in_use_again(task)
            done = True
        else:
            done = True
        if done:
            counts[judged.verdict.value] += 1
        if judged.verdict != Verdict.NONE:
            logger.info("interactive task %s: %s (last in use %s)", task.pk, judged.verdict, judged.last_busy)
    return counts
