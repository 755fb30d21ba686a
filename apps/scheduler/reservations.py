"""No starvation: the head of each priority that waited too long reserves (the core holds
the cards it waits for); its report is stored on the group, cycle by cycle."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import orjson
from django.db import connection

from apps.scheduler.core import (
    Held,
)
from apps.tasks.models import TaskGroup


def reserving_groups(heads: dict[int, dict], now, after_seconds: float) -> dict[int, tuple[str, ...]]:
    """The heads that have waited at the head of their priority for `after_seconds` or
    more, each with the nodes its reservation targeted last cycle (the core keeps them
    first, so the holds accumulate on the same nodes)."""
    reserving = {}
    for group_id, stored in heads.items():
        since = head_since(stored, now)
        if (now - since).total_seconds() >= after_seconds:
            reserving[group_id] = tuple(entry["node_id"] for entry in stored.get("nodes", ()))
    return reserving


def head_since(stored: dict, now):
    """When the group became the head of its priority, by its stored report (now, for a
    group that just became it)."""
    since = stored.get("head_since")
    return datetime.fromisoformat(since) if since else now


def reservation_reports(heads: dict[int, dict], failures, now, after_seconds: float) -> dict[int, dict]:
    """The report to store on each head that is still waiting after this cycle (those
    placed are cleared by bind): since when it is the head, from when it reserves, and
    what it holds (`state` "holding", the nodes with the cards wanted and held on each)
    or "waiting" (not reserving yet, or nothing it could hold: its type's nodes cannot
    take it even when free)."""
    reports = {}
    for failure in failures:
        if failure.group_id not in heads:
            continue
        since = head_since(heads[failure.group_id], now)
        report = {
            "state": "waiting",
            "head_since": since.isoformat(),
            "reserves_after": (since + timedelta(seconds=after_seconds)).isoformat(),
        }
        if failure.reservation is not None:
            report |= {"state": "holding", **failure.reservation.as_dict()}
            if failure.reservation.expected_free is not None:
                # in words for people; `expected_free` (epoch seconds) for the dry runs behind it
                freed = datetime.fromtimestamp(failure.reservation.expected_free, UTC)
                report["expected_free_at"] = freed.isoformat()
        reports[failure.group_id] = report | {"at": now.isoformat()}
    return reports


def standing_reservations(priority: int, exclude: int | None = None) -> list[Held]:
    """What the last cycle held for the groups of this priority or higher (their stored
    reports), but `exclude`'s own: the holds a request of that priority would meet now."""
    rows = (
        TaskGroup.objects.filter(reservation__state="holding", priority__gte=priority)
        .exclude(pk=exclude)
        .values_list("pk", "tenant_id", "reservation")
    )
    return [
        Held(
            pk,
            tenant_id,
            {entry["node_id"]: entry["held"] for entry in report.get("nodes", ())},
            report.get("expected_free"),
        )
        for pk, tenant_id, report in rows
    ]


# A head's report, written by every scheduler process that ran the cycle (the same report
# for the same head): a row another one is writing (or a bind is clearing) is skipped, not
# waited for, so the statement never waits on a lock and never joins a deadlock. The
# reports of groups that are no longer heads are cleared by the window's statement.
STORE_RESERVATIONS = """
    UPDATE task_groups AS g SET reservation = v.report
    FROM unnest(%s::bigint[], %s::jsonb[]) AS v(id, report)
    WHERE g.id = v.id
      AND g.id IN (SELECT id FROM task_groups WHERE id = ANY(%s) ORDER BY id FOR UPDATE SKIP LOCKED)
"""


def store_reservations(reports: dict[int, dict]) -> None:
    """Write this cycle's reservation reports, one per head still waiting."""
    if not reports:
        return
    ids = list(reports)
    documents = [orjson.dumps(report).decode() for report in reports.values()]
    with connection.cursor() as cursor:
        cursor.execute(STORE_RESERVATIONS, [ids, documents, ids])
