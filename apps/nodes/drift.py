"""Memory drift: a card's measured use that the GPU ledger does not explain
(docs/scheduler.md#admission-on-what-is-really-free).

Per card of a node the failure policy still counts on (heard from within
HETEROFLOW_NODE_OFFLINE_SECONDS) that is not lost and has a reading:

- explained = what the ledger holds on it (the sum of its shares' memory_mb); a card
  with a whole-card holder explains all of its use;
- drift = memory_used_mb − explained.

A drift above HETEROFLOW_GPU_MEMORY_DRIFT_MB marks the card (`memory_drift_since`, the
first time it was seen; `memory_drift_mb`, the latest amount); once it has lasted
HETEROFLOW_GPU_MEMORY_DRIFT_BEATS × the node's heartbeat interval, GPU_MEMORY_DRIFT is
raised (warning, scope gpu), naming the node, the card and the MB. When the drift ends
(at or below the threshold, or the card stops reporting memory) the marks are cleared
and the alert recovered. A node given up or a lost card is not judged at all (its
reading is stale): its marks and alert stay as they were until it reports again.

A periodic job (apps.nodes.jobs, every 10 s) calls `check_memory_drift`: one read of the
cards, set-based writes for the cards that changed, an alert per card that crossed.
The ledger's table is read by name (raw SQL), so this layer imports no scheduler code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.services import NewAlert, raise_alerts, recover_alert
from apps.core.clock import utcnow
from apps.nodes import liveness

# The cards to judge: counted on (not given up), present, with a reading or a drift mark
# to clear; each with what the ledger holds on it and whether a whole-card holder is there.
CARDS_SQL = f"""
    SELECT g.id, g.node_id, n.name, g.index, g.memory_used_mb, g.memory_drift_since, n.heartbeat_interval,
           coalesce(a.explained, 0), coalesce(a.whole, false)
    FROM gpus g
    JOIN nodes n ON n.id = g.node_id
    LEFT JOIN (
        SELECT node_id, gpu_index, sum(memory_mb)::bigint AS explained, bool_or(memory_mb IS NULL) AS whole
        FROM gpu_allocations GROUP BY node_id, gpu_index
    ) a ON a.node_id = g.node_id AND a.gpu_index = g.index
    WHERE g.lost_at IS NULL AND n.status <> 'offline' AND {liveness.heard_from_sql("n.last_heartbeat_at")}
      AND (g.memory_used_mb IS NOT NULL OR g.memory_drift_since IS NOT NULL)
"""
MARK_SQL = """
    UPDATE gpus AS g SET memory_drift_since = coalesce(g.memory_drift_since, %s), memory_drift_mb = v.mb
    FROM unnest(%s::bigint[], %s::bigint[]) AS v(id, mb) WHERE g.id = v.id
"""
CLEAR_SQL = "UPDATE gpus SET memory_drift_since = NULL, memory_drift_mb = NULL WHERE id = ANY(%s)"


@dataclass
class DriftReport:
    marked: list[tuple[str, int]] = field(default_factory=list)  # (node, card) drifting now
    raised: list[tuple[str, int]] = field(default_factory=list)  # alerts newly raised
    recovered: list[tuple[str, int]] = field(default_factory=list)  # drifts that ended


def threshold_mb() -> int:
    return settings.HETEROFLOW_GPU_MEMORY_DRIFT_MB


def check_memory_drift(now: datetime | None = None) -> DriftReport:
    """Judge every card once (see the module's docstring). Idempotent: a second run at
    the same moment changes nothing more."""
    now = now or utcnow()
    limit, beats = threshold_mb(), settings.HETEROFLOW_GPU_MEMORY_DRIFT_BEATS
    report = DriftReport()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(CARDS_SQL, [liveness.heard_since(now)])
        rows = cursor.fetchall()
        marks: dict[int, int] = {}
        cleared: list[int] = []
        alerts: list[NewAlert] = []
        for gpu_id, node_id, name, index, used, since, interval, explained, whole in rows:
            drift = 0 if whole or used is None else used - explained
            if drift <= limit:
                if since is not None:
                    cleared.append(gpu_id)
                    report.recovered.append((node_id, index))
                continue
            marks[gpu_id] = drift
            report.marked.append((node_id, index))
            first_seen = since or now
            if now - first_seen >= timedelta(seconds=beats * (interval or 5)):
                alerts.append(_alert(node_id, name, index, used, explained, drift, limit))
        if marks:
            cursor.execute(MARK_SQL, [now, list(marks), list(marks.values())])
        if cleared:
            cursor.execute(CLEAR_SQL, [cleared])
        new = raise_alerts(alerts)
        report.raised = [(a.node_id, a.gpu_index) for a in alerts if a.key in new]
        for node_id, index in report.recovered:
            recover_alert(alert_keys.gpu_memory_drift(node_id, index))
    return report


def _alert(node_id: str, name: str, index: int, used: int, explained: int, drift: int, limit: int) -> NewAlert:
    shown = f"{name} ({node_id})" if name and name != node_id else node_id
    return NewAlert(
        type=AlertType.GPU_MEMORY_DRIFT,
        severity=Severity.WARNING,
        scope=AlertScope.GPU,
        key=alert_keys.gpu_memory_drift(node_id, index),
        message=(
            f"GPU {index} of node {shown} uses {drift} MB more memory than the platform placed on it "
            f"({used} MB measured, {explained} MB explained by the ledger; threshold {limit} MB)."
        ),
        node_id=node_id,
        gpu_index=index,
        details={"measured_mb": used, "explained_mb": explained, "drift_mb": drift, "threshold_mb": limit},
    )
