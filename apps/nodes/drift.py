"""Memory drift: a card's measured use that the GPU ledger does not explain
(docs/scheduler.md#memory-drift), judged inside the heartbeat's own statement.

Per card of the beating node that is not lost:

- explained = what the ledger holds on it (the sum of its shares' memory_mb); a card
  with a whole-card holder explains all of its use;
- drift = the beat's memory_used_mb − explained (0 when the beat has no reading).

A drift above HETEROFLOW_GPU_MEMORY_DRIFT_MB marks the card (`memory_drift_since`, the
first time it was seen; `memory_drift_mb`, the latest amount); once it has lasted the span
(HETEROFLOW_GPU_MEMORY_DRIFT_BEATS × the node's heartbeat interval), GPU_MEMORY_DRIFT is
raised (warning, scope gpu), naming the node, the card and the MB. A drift ends the same
way it starts: once the card has been at or below the threshold (or has read no memory)
for the span, counted from its first such beat (`memory_drift_ended_at`), the marks are
cleared and the alert recovered. A dip shorter than the span clears nothing, so a card
whose unplaced use hovers around the threshold keeps one alert instead of raising and
recovering one every few beats (a busy fleet's bench saw about 100 a second). A lost
card is not judged (its reading is stale), nor are the cards of a beat whose collector
failed (it read none of them), and a node given up sends no beat: their marks and
alerts stay as they were until they report again.

Why in the beat: a card's drift changes when its reading does, and on a busy fleet every
card's reading moves every beat, so a sweep would judge the whole fleet on every run and
write other nodes' card rows while their beats write them (the deadlock of a sweep that
takes rows in another order than the beats). In the beat the work is the beating node's
own cards, in the rows the beat already writes, under the beat's own locks: one index
lookup of the ledger per beat, nothing more. A ledger change between beats (a task bound
or released) is judged at the node's next beat.

These are the statement's pieces; apps.nodes.heartbeat puts them together. The ledger's
table is read by name, so this layer imports no scheduler code.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertType, Severity

# What the ledger holds on each card of the beating node (an index scan of
# allocation_node_card): the shares' memory, and whether a whole-card holder is there.
LEDGER_JOIN = """
    LEFT JOIN (
        SELECT gpu_index, sum(memory_mb)::bigint AS explained, bool_or(memory_mb IS NULL) AS whole
        FROM gpu_allocations WHERE node_id = %(id)s GROUP BY gpu_index
    ) AS l ON l.gpu_index = g2.index
"""

# Per card (`g2`: the row before the beat, `r`: the beat's reading, `l`: the ledger):
# the drift, NULL when not judged (a lost card, a beat whose collector failed: no
# reading of any card); the mark before the beat; what the ledger explains.
DRIFT_COLUMNS = """
    CASE WHEN g2.lost_at IS NOT NULL OR %(collector_error)s THEN NULL
         WHEN COALESCE(l.whole, false) OR r.m IS NULL THEN 0
         ELSE r.m - COALESCE(l.explained, 0) END AS drift,
    g2.memory_drift_since AS drift_was, COALESCE(l.explained, 0) AS explained
"""

# The marks, in the beat's UPDATE of the cards (`s`: the columns above). Per card, one of:
# not judged (the marks stay); over the threshold (marked, any ending forgotten); under it
# with no mark (nothing); under it with a mark: ending, from its first such beat, and
# ended (the marks cleared) once that has lasted the span.
DRIFT_SET = """
    memory_drift_since = CASE WHEN s.drift IS NULL THEN g.memory_drift_since
                              WHEN s.drift > %(drift_mb)s::bigint THEN COALESCE(g.memory_drift_since, %(now)s)
                              WHEN %(now)s - COALESCE(g.memory_drift_ended_at, %(now)s) >= %(drift_span)s THEN NULL
                              ELSE g.memory_drift_since END,
    memory_drift_mb = CASE WHEN s.drift IS NULL THEN g.memory_drift_mb
                           WHEN s.drift > %(drift_mb)s::bigint THEN s.drift
                           WHEN g.memory_drift_since IS NULL
                                OR %(now)s - COALESCE(g.memory_drift_ended_at, %(now)s) >= %(drift_span)s THEN NULL
                           ELSE g.memory_drift_mb END,
    memory_drift_ended_at = CASE WHEN s.drift IS NULL THEN g.memory_drift_ended_at
                                 WHEN s.drift > %(drift_mb)s::bigint OR g.memory_drift_since IS NULL
                                      OR %(now)s - COALESCE(g.memory_drift_ended_at, %(now)s) >= %(drift_span)s
                                     THEN NULL
                                 ELSE COALESCE(g.memory_drift_ended_at, %(now)s) END
"""

# The alert, from the beat's judged cards (`judged`: the UPDATE's RETURNING; `node`: the
# node's row): raised once a drift has lasted the beats. An alert already active is seen
# by a plain read of the active-key index and not inserted again (a scalar subquery,
# probed per card: NOT EXISTS would be planned as an anti-join over every active alert,
# on every beat): an INSERT … ON CONFLICT
# that meets the key would wait for any transaction that has just updated that alert row
# (the notification dispatcher's claim), and a beat never waits on the outbox
# (docs/architecture.md#lock-order). Its recovery is the beat's, with GPU_LOST's
# (`DRIFT_OVER_KEYS`: the cards judged without a drift whose mark this beat cleared, or
# every such card on a recheck beat: apps.nodes.heartbeat.rechecks_alerts).
_KEY = alert_keys.gpu_memory_drift_sql("%(id)s", "j.index")
DRIFT_RAISED = f"""
drift_raised AS (
    INSERT INTO alerts (type, severity, scope, state, key, node_id, gpu_index, message, details, created_at, updated_at)
    SELECT '{AlertType.GPU_MEMORY_DRIFT}', '{Severity.WARNING}', '{AlertScope.GPU}', 'ACTIVE', {_KEY}, %(id)s, j.index,
           format('GPU %%s of node %%s uses %%s MB more memory than the platform placed on it ' ||
                  '(%%s MB measured, %%s MB explained by the ledger; threshold %%s MB).',
                  j.index, CASE WHEN nd.node_name <> '' AND nd.node_name <> %(id)s
                                THEN nd.node_name || ' (' || %(id)s || ')' ELSE %(id)s END,
                  j.drift, j.memory_used_mb, j.explained, %(drift_mb)s::bigint),
           jsonb_build_object('measured_mb', j.memory_used_mb, 'explained_mb', j.explained, 'drift_mb', j.drift,
                              'threshold_mb', %(drift_mb)s::bigint),
           %(now)s, %(now)s
    FROM judged AS j CROSS JOIN node AS nd
    WHERE j.drift > %(drift_mb)s::bigint AND %(now)s - j.memory_drift_since >= %(drift_span)s
      AND (SELECT 1 FROM alerts WHERE state = 'ACTIVE' AND key = {_KEY} LIMIT 1) IS NULL
    ON CONFLICT (key) WHERE state = 'ACTIVE' DO NOTHING
)"""
DRIFT_OVER_KEYS = (
    f"SELECT {_KEY} FROM judged AS j WHERE j.drift IS NOT NULL AND j.memory_drift_since IS NULL"
    " AND (j.drift_was IS NOT NULL OR %(recheck)s)"
)


def drift_params(heartbeat_interval: float) -> dict:
    """The beat's parameters for the drift: the threshold and how long a drift must last
    (the beats × this node's interval)."""
    return {
        "drift_mb": settings.HETEROFLOW_GPU_MEMORY_DRIFT_MB,
        "drift_span": timedelta(seconds=settings.HETEROFLOW_GPU_MEMORY_DRIFT_BEATS * heartbeat_interval),
    }
