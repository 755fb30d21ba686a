"""Heartbeat ingestion: the hottest path of the control plane.

A steady-state beat is ONE statement, whatever the cluster size, so one round trip to
PostgreSQL and atomic without an explicit transaction. Its data-modifying CTEs: the
narrow UPDATE of the node's heartbeat columns (guarded by the structure hash); only if
that matched, the readings of all the node's GPU rows with the lost-card and
memory-drift judgements (apps.nodes.drift); the metrics sample; and the GPU_LOST and
GPU_MEMORY_DRIFT alerts this beat raises or recovers. A beat whose
structure changed (GPU models, specs, labels, agent version…) or a first beat takes the
slow path in a transaction, which is rare. Nothing here reads another node.

Locks: a beat takes its node's row, then its cards' rows (the UPDATE walks them by the
(node_id, index) key), and nothing of another node. Every other writer of node and card
rows keeps to that order or skips the rows a beat holds (docs/architecture.md#lock-order).

A beat carrying `gpu_health` whose hash differs from the node's `health_hash` takes
one more step after the beat (apps.nodes.health): the cards' health readings change
rarely, so a steady beat pays one column compare for them.

Which row each card of a beat is: the slow path matches the beat's cards to the node's
rows by UUID or PCI address where both carry one (apps.nodes.card_identity), so a vendor
tool that renumbers its cards after one drops out does not shift the others' names; each
row keeps the index the agent reports it under now (`reported_index`), and the steady
beat reads the readings by that. A card known only by its position (no identity, and an
agent that says its indices are positions) that goes missing is judged lost with the
note that which card it was cannot be told.

Labels merge by key, except those the agent owns: an agent that sends
`owned_label_keys` may remove a label it set itself, by leaving it out of a later beat
(`nodes.agent_label_keys` remembers which keys those are). Leaving a key out changes the
labels, so removal happens on the slow path only. The cordon label is the operators'
(apps.nodes.services): an agent neither sets nor removes it.
"""

from __future__ import annotations

import hashlib
import logging
import re
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

import orjson
from django.conf import settings
from psycopg import AsyncRawCursor
from psycopg.types.json import Jsonb, set_json_dumps

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.nodes import card_identity, drift, energy, health, liveness
from apps.nodes.choices import (
    CORDON_LABEL,
    LOST_AFTER_BEATS,
    RECOVERED_AFTER_BEATS,
    CardIdentity,
    CordonSource,
    is_dirty_build,
)
from apps.nodes.normalize import gpu_model

logger = logging.getLogger(__name__)

set_json_dumps(lambda obj: orjson.dumps(obj).decode())


# --- the structural facts ---------------------------------------------------------------
# What a beat says about the node and its cards rather than their state: a change of any
# takes the slow path (a full-row update and the cards' upsert). The key lists below are
# derived from these tables, once, at import.


class Fact(NamedTuple):
    key: str  # in the beat, and the column of that name (the node's, or its card's)
    default: object = ""  # what a beat without it says
    json: bool = False  # a JSON column
    merged: bool = False  # merged into the column by key on the slow path, not replaced


# Hashed in this order, so a stored hash stays what it was: a new fact is hashed after
# them, and only when sent, as the CPU facts are; never in between.
NODE_FACTS = (
    Fact("hostname"),
    Fact("os"),
    Fact("cpu_cores", None),
    Fact("memory_gb", None),
    Fact("mac"),  # written normalized: lower case, colons
    Fact("is_container", False),
    Fact("agent_version"),
    Fact("agent_git_commit"),
    Fact("agent_build_time"),
    Fact("gpu_capabilities", {}, json=True),
    Fact("labels", {}, json=True, merged=True),  # less the cordon label (agent_labels, label_ownership)
    Fact("vllm_available", False),
    Fact("inference_engines", [], json=True),
    Fact("inference_engine_versions", {}, json=True),
    Fact("discovered_models", [], json=True),
)
# Facts newer agents send: hashed after the others, and only when sent, so that an older
# agent's hash stays what it was (likewise `owned_label_keys`, see label_ownership).
CPU_FACTS = (Fact("cpu_model"), Fact("cpu_sockets", None))


class CardFact(NamedTuple):
    key: str  # in the beat's gpu_stats, and the gpus column of that name
    default: object
    sql_type: str


# A card's, in the order structure_hash hashes them (index and vendor are always sent;
# pci_bus_id, newer, is hashed only when sent).
CARD_FACTS = (
    CardFact("index", None, "int"),
    CardFact("uuid", "", "text"),
    CardFact("vendor", None, "text"),
    CardFact("model", "", "text"),
    CardFact("memory_total_mb", None, "bigint"),
    CardFact("compute_capability", "", "text"),
    CardFact("pci_bus_id", "", "text"),
)
# Where the slow path placed each card (apps.nodes.card_identity): written with its facts.
CARD_PLACEMENT = (("reported_index", "int"), ("matched_by", "text"))
INDEX_BASIS = "gpu_index_basis"  # how the agent numbers its cards: hashed only when sent

STRUCTURAL_KEYS = tuple(fact.key for fact in NODE_FACTS)
CPU_MODEL, CPU_SOCKETS = (fact.key for fact in CPU_FACTS)
# what the slow path writes as sent, whole; then what it derives from the facts
COPIED_FACTS = tuple(fact for fact in NODE_FACTS + CPU_FACTS if not fact.merged)
DERIVED_COLUMNS = ("gpu_type", "gpu_model", "cpu_tdp_w_model", "structure_hash")  # the hash: beat_params
MERGED_COLUMNS = tuple(fact.key for fact in NODE_FACTS if fact.merged)
CARD_COLUMNS = tuple(fact.key for fact in CARD_FACTS)

METRIC_FIELDS = ("utilization", "memory_used_mb", "temperature", "power_w")
# Short keys of the per-GPU readings sent to SQL and kept in node_metrics.
READING_KEYS = (("u", "utilization"), ("m", "memory_used_mb"), ("t", "temperature"), ("p", "power_w"))


def structure_hash(payload: dict) -> str:
    # each card's CARD_FACTS, in their order, written out: this runs on every beat
    gpus = sorted(
        (
            g["index"],
            g.get("uuid", ""),
            g["vendor"],
            g.get("model", ""),
            g.get("memory_total_mb"),
            g.get("compute_capability", ""),
        )
        + ((g["pci_bus_id"],) if "pci_bus_id" in g else ())  # only when sent, as below
        for g in payload.get("gpu_stats", ())
    )
    facts = [payload.get(key) for key in STRUCTURAL_KEYS]
    if "owned_label_keys" in payload:  # only then: an older agent's hash stays what it was
        facts.append(sorted(payload["owned_label_keys"]))
    if CPU_MODEL in payload or CPU_SOCKETS in payload:  # likewise
        facts.append([payload.get(CPU_MODEL), payload.get(CPU_SOCKETS)])
    if INDEX_BASIS in payload:  # likewise; the cards are matched again when it changes
        facts.append(payload[INDEX_BASIS])
    document = orjson.dumps([facts, gpus], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(document, digest_size=16).hexdigest()


def reading(stat: dict, name: str):
    """A GPU reading, or None when the agent did not read it (absent, or not listed in
    metrics_available when the agent sends that list)."""
    available = stat.get("metrics_available")
    if available is not None and name not in available:
        return None
    return stat.get(name)


@dataclass
class GpuChange:
    index: int
    lost: bool
    basis: str
    identified: bool = True  # False: a card known only by its position; which one went cannot be told


@dataclass
class BeatOutcome:
    node_id: str
    status: str
    registered: bool = False
    scheduled_task_ids: list[int] = field(default_factory=list)
    slow_path: bool = False
    gpu_changes: list[GpuChange] = field(default_factory=list)
    health_changed: bool = False


# --- statements -----------------------------------------------------------------------

HEARTBEAT_COLUMNS = (
    "last_heartbeat_at",
    "status",
    "ip",
    "internal_ip",
    "internal_prefix",
    "cpu_used",
    "memory_used",
    "gpu_temperature",
    "gpu_memory_used_mb",
    "docker_available",
    "executable",
    "exec_mode",
    "error_message",
    "gpu_collector_error",
    "task_health",
    "live_task_ids",
    "heartbeat_interval",
    "updated_at",
    "signed_off_at",
)
STRUCTURE_COLUMNS = tuple(fact.key for fact in COPIED_FACTS) + DERIVED_COLUMNS

# The beat's real interval is the time since the node's previous beat, both server
# receipt times (`dt`, seconds). Energy is integrated over it only when both ends were
# measured and it is at most three of the node's beats (`max_span`): a card's power read
# at the previous beat (power_at = that beat) and now, the node's CPU estimate likewise;
# otherwise the time since the card's last measured power is a gap (energy_gap_seconds),
# and nothing is invented for it. A beat from a collector error measures no card.
BEAT = f"""
WITH node AS (
    UPDATE nodes AS n SET {", ".join(f"{column} = %({column})s" for column in HEARTBEAT_COLUMNS)},
        cpu_power_w_estimate = o.ce,
        cpu_power_at = CASE WHEN o.ce IS NULL THEN n.cpu_power_at ELSE %(now)s END,
        cpu_energy_wh_estimate = n.cpu_energy_wh_estimate + COALESCE(CASE
            WHEN o.cpu_power_at = o.ol AND o.dt > 0 AND o.dt <= %(max_span)s
            THEN (o.cpu_power_w_estimate + o.ce) * o.dt / 7200 END, 0)
    FROM (SELECT id, health_hash AS oh, last_heartbeat_at AS ol, cpu_power_at, cpu_power_w_estimate,
                 extract(epoch FROM %(now)s - last_heartbeat_at)::float8 AS dt,
                 COALESCE(cpu_tdp_w, cpu_tdp_w_model)
                     * (%(idle)s + (1 - %(idle)s) * %(cpu_used)s::float8 / 100) AS ce
          FROM nodes WHERE id = %(id)s) AS o
    WHERE n.id = o.id AND n.structure_hash = %(structure_hash)s
    RETURNING o.oh, o.ol, o.dt, n.name AS node_name
), readings AS (
    SELECT * FROM jsonb_to_recordset(%(readings)s::jsonb) AS r(i int, u float8, m bigint, t float8, p float8, a text)
), judged AS (
    UPDATE gpus AS g SET
        utilization = s.u, memory_used_mb = s.m, temperature = s.t, power_w = s.p,
        metrics_available = COALESCE(to_jsonb(string_to_array(NULLIF(s.a, ''), ',')), '[]'::jsonb),
        absent_streak = CASE s.kind WHEN 'skip' THEN g.absent_streak WHEN 'present' THEN 0
                             ELSE LEAST(g.absent_streak + 1, 1000) END,
        absent_basis = CASE s.kind WHEN 'skip' THEN g.absent_basis WHEN 'present' THEN 0
                            WHEN 'failed' THEN g.absent_basis | 2 ELSE g.absent_basis | 1 END,
        present_streak = CASE s.kind WHEN 'present' THEN LEAST(g.present_streak + 1, 1000)
                              WHEN 'skip' THEN g.present_streak ELSE 0 END,
        lost_at = CASE
            WHEN s.kind IN ('absent', 'failed') AND g.lost_at IS NULL AND g.absent_streak + 1 >= {LOST_AFTER_BEATS}
                THEN %(now)s
            WHEN s.kind = 'present' AND g.lost_at IS NOT NULL AND g.present_streak + 1 >= {RECOVERED_AFTER_BEATS}
                THEN NULL
            ELSE g.lost_at END,
        lost_basis = CASE
            WHEN s.kind IN ('absent', 'failed') AND g.lost_at IS NULL AND g.absent_streak + 1 >= {LOST_AFTER_BEATS}
                THEN CASE (g.absent_basis | CASE s.kind WHEN 'failed' THEN 2 ELSE 1 END)
                     WHEN 1 THEN 'heartbeat_absent' WHEN 2 THEN 'agent_collect_failure' ELSE 'mixed' END
            WHEN s.kind = 'present' AND g.lost_at IS NOT NULL AND g.present_streak + 1 >= {RECOVERED_AFTER_BEATS}
                THEN ''
            ELSE g.lost_basis END,
        energy_wh = g.energy_wh + CASE WHEN s.ms AND s.ok THEN (g.power_w + s.p) * s.dt / 7200 ELSE 0 END,
        energy_gap_seconds = g.energy_gap_seconds
            + CASE WHEN s.ms AND NOT s.ok THEN COALESCE(GREATEST(s.since, 0), 0) ELSE 0 END,
        power_at = CASE WHEN s.ms THEN %(now)s ELSE g.power_at END,
        energy_since = CASE WHEN s.ms THEN COALESCE(g.energy_since, %(now)s) ELSE g.energy_since END,
        {drift.DRIFT_SET},
        updated_at = %(now)s
    FROM (
        SELECT g2.id, g2.lost_at IS NOT NULL AS was_lost,
               CASE WHEN %(collector_error)s THEN 'skip'
                    WHEN g2.reported_index = ANY(%(failed)s::int[]) THEN 'failed'
                    WHEN r.i IS NULL THEN 'absent'
                    ELSE 'present' END AS kind,
               r.u, r.m, r.t, r.p, r.a,
               NOT %(collector_error)s AND r.p IS NOT NULL AS ms,
               COALESCE(g2.power_at = nd.ol AND g2.power_w IS NOT NULL AND nd.dt > 0 AND nd.dt <= %(max_span)s,
                        false) AS ok,
               nd.dt, extract(epoch FROM %(now)s - g2.power_at)::float8 AS since,
               {drift.DRIFT_COLUMNS}
        FROM gpus AS g2 CROSS JOIN node AS nd
        LEFT JOIN readings AS r ON r.i = g2.reported_index AND NOT (g2.reported_index = ANY(%(failed)s::int[]))
        {drift.LEDGER_JOIN}
        WHERE g2.node_id = %(id)s
    ) AS s
    WHERE g.id = s.id
    RETURNING g.index, s.was_lost, g.lost_at IS NOT NULL AS is_lost, g.lost_basis,
              s.drift, s.drift_was, s.explained, g.memory_drift_since, g.memory_used_mb,
              g.matched_by, g.uuid, g.pci_bus_id, s.kind, s.u, s.t, s.p
), metric AS (
    INSERT INTO node_metrics (node_id, at, cpu_used, memory_used, gpus)
    SELECT %(id)s, %(now)s, %(cpu_used)s, %(memory_used)s,
           (SELECT COALESCE(jsonb_agg(jsonb_strip_nulls(jsonb_build_object(
                                'i', j.index, 'u', j.u, 'm', j.memory_used_mb, 't', j.t, 'p', j.p)) ORDER BY j.index),
                            '[]'::jsonb)
            FROM judged AS j WHERE j.kind = 'present')
    FROM node
), raised AS (
    INSERT INTO alerts (type, severity, scope, state, key, node_id, gpu_index, message, details, created_at, updated_at)
    SELECT '{AlertType.GPU_LOST}', '{Severity.ERROR}', '{AlertScope.GPU}', 'ACTIVE',
           {alert_keys.gpu_lost_sql("%(id)s", "j.index")}, %(id)s,
           CASE WHEN j.matched_by = '{CardIdentity.POSITION}' THEN NULL ELSE j.index END,
           CASE j.matched_by
               WHEN '{CardIdentity.UUID}' THEN
                   format('GPU %%s of node %%s (UUID %%s) is lost (%%s).', j.index, %(id)s, j.uuid, j.lost_basis)
               WHEN '{CardIdentity.PCI_BUS_ID}' THEN
                   format('GPU %%s of node %%s (PCI %%s) is lost (%%s).', j.index, %(id)s, j.pci_bus_id, j.lost_basis)
               WHEN '{CardIdentity.POSITION}' THEN
                   format('A GPU of node %%s is lost (%%s), and which one cannot be told: its tool renumbers '
                          || 'the cards after one drops out and prints no UUID or PCI address, so position %%s, '
                          || 'the one that went missing, need not be the card that failed.',
                          %(id)s, j.lost_basis, j.index)
               ELSE format('GPU %%s of node %%s is lost (%%s).', j.index, %(id)s, j.lost_basis) END,
           jsonb_build_object('basis', j.lost_basis, 'matched_by', j.matched_by,
                              'identified', j.matched_by <> '{CardIdentity.POSITION}')
           || CASE j.matched_by WHEN '{CardIdentity.UUID}' THEN jsonb_build_object('uuid', j.uuid)
                                WHEN '{CardIdentity.PCI_BUS_ID}' THEN jsonb_build_object('pci_bus_id', j.pci_bus_id)
                                WHEN '{CardIdentity.POSITION}' THEN jsonb_build_object('position', j.index)
                                ELSE '{{}}'::jsonb END,
           %(now)s, %(now)s
    FROM judged AS j WHERE j.is_lost AND NOT j.was_lost
      AND (SELECT 1 FROM alerts WHERE state = 'ACTIVE'
           AND key = {alert_keys.gpu_lost_sql("%(id)s", "j.index")} LIMIT 1) IS NULL
    ON CONFLICT (key) WHERE state = 'ACTIVE' DO NOTHING
), {drift.DRIFT_RAISED}, recovered AS (
    UPDATE alerts SET state = 'RECOVERED', ended_at = %(now)s, updated_at = %(now)s
    WHERE id IN (
        SELECT a.id
        FROM (SELECT {alert_keys.gpu_lost_sql("%(id)s", "j.index")} AS key FROM judged AS j
              WHERE NOT j.is_lost AND (j.was_lost OR %(recheck)s)
              UNION ALL {drift.DRIFT_OVER_KEYS}) AS k
        CROSS JOIN LATERAL (
            SELECT id FROM alerts WHERE state = 'ACTIVE' AND key = k.key FOR UPDATE SKIP LOCKED) AS a)
)
SELECT EXISTS (SELECT 1 FROM node), (SELECT oh FROM node),
       (SELECT COALESCE(jsonb_agg(jsonb_build_array(j.index, j.is_lost, j.lost_basis,
                                                    j.matched_by <> '{CardIdentity.POSITION}')), '[]'::jsonb)
        FROM judged AS j WHERE j.was_lost <> j.is_lost),
       ARRAY(SELECT t.id FROM tasks AS t WHERE t.node_id = %(id)s AND t.status = 'scheduled'
             ORDER BY t.priority DESC, t.created_at, t.id LIMIT 50)
"""

# `recovered`: the alerts of this node's cards whose condition is over (GPU_LOST of a card
# that is not lost, GPU_MEMORY_DRIFT of a card judged without a drift). Asked of the cards
# whose condition ended in this beat, and of every card on the node's recheck beats
# (`rechecks_alerts`: about once a minute), a probe of the active-key index per card
# (spelled as a LATERAL lookup so that no plan, generic or custom, scans the active
# alerts), so an alert row the notification dispatcher holds now is skipped and recovered
# by a later recheck: a beat never waits on the outbox (docs/architecture.md#lock-order).
# Probing every card on every beat cost a steady beat 15 % (make bench: 1,300 against
# 1,500 beats/s at saturation). `raised` (and the drift's)
# inserts only a key with no active alert, seen by a plain read (a scalar subquery
# probed per card; NOT EXISTS is planned as an anti-join over every active alert): an INSERT … ON CONFLICT
# that meets an alert row the dispatcher has just claimed would wait for its commit.
# (No SQL comments in BEAT: it is sent collapsed onto one line.)

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%|%")


def positional(query: str) -> tuple[str, tuple[str, ...]]:
    """A statement written with named placeholders (`%(name)s`, `%%` for a literal %),
    as PostgreSQL's own positional one (`$1`…, one number per name) and the names in
    that order. Run on a raw cursor, such a statement is sent as it is: psycopg parses
    nothing client-side on any execution, whatever its length."""
    names: list[str] = []

    def replace(match: re.Match) -> str:
        if match.group(0) == "%%":
            return "%"
        if match.group(1) is None:
            raise ValueError(f"a bare % at {match.start()} of the statement: write %% or %(name)s")
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return _PLACEHOLDER.sub(replace, query), tuple(names)


# Compiled once: the beat runs on a raw cursor (psycopg would parse a named statement of
# this length again on every execution, 400 times a second), collapsed to one line.
BEAT_SQL, BEAT_PARAMS = positional(" ".join(BEAT.split()))


def beat_values(params: dict) -> list:
    return [params[name] for name in BEAT_PARAMS]


# Not last_heartbeat_at: the beat that follows in the same transaction sets it, and reads
# the previous one first (the beat's real interval, for the energy accumulators).
FULL_NODE_UPDATE = (
    "UPDATE nodes SET "
    + ", ".join(
        f"{column} = %({column})s" for column in HEARTBEAT_COLUMNS + STRUCTURE_COLUMNS if column != "last_heartbeat_at"
    )
    + ", labels = (labels || %(labels)s) - %(label_removals)s::text[]"
    + ", agent_label_keys = COALESCE(%(agent_label_keys)s, agent_label_keys) WHERE id = %(id)s"
)

NODE_INSERT_COLUMNS = (
    HEARTBEAT_COLUMNS
    + STRUCTURE_COLUMNS
    + (
        *MERGED_COLUMNS,
        "id",
        "name",
        "agent_label_keys",
        "region",
        "zone",
        "rack",
        "version",
        "registered_at",
        "gpu_count",
    )
)
NODE_INSERT = (
    f"INSERT INTO nodes ({', '.join(NODE_INSERT_COLUMNS)}) VALUES ("
    + ", ".join(f"%({column})s" for column in NODE_INSERT_COLUMNS)
    + ") ON CONFLICT (id) DO NOTHING"
)

_UPSERTED = CARD_COLUMNS + tuple(column for column, _ in CARD_PLACEMENT)
_UPSERTED_TYPES = [f"{fact.key} {fact.sql_type}" for fact in CARD_FACTS] + [f"{c} {t}" for c, t in CARD_PLACEMENT]
GPU_UPSERT = f"""
    INSERT INTO gpus (node_id, {", ".join(_UPSERTED)}, metrics_available,
                      absent_streak, absent_basis, present_streak, lost_basis, updated_at)
    SELECT %(id)s, {", ".join(f"u.{column}" for column in _UPSERTED)}, '[]'::jsonb,
           0, 0, 0, '', %(now)s
    FROM jsonb_to_recordset(%(gpus)s::jsonb)
         AS u({", ".join(_UPSERTED_TYPES)})
    ON CONFLICT (node_id, index) DO UPDATE SET
        {", ".join(f"{column} = EXCLUDED.{column}" for column in _UPSERTED if column != "index")}
"""
# The node's rows as the slow path matches the beat's cards to them, locked in the
# documented order (the node's row first, then its cards by index).
GPUS_FOR_UPDATE = "SELECT index, uuid, pci_bus_id FROM gpus WHERE node_id = %(id)s ORDER BY index FOR UPDATE"
# The rows the upsert does not write: a card only a collect failure names (its row, at the
# index the agent gave the failure), and a card the beat left out (null).
GPU_REPORTED_UPDATE = """
    UPDATE gpus AS g SET reported_index = p.r
    FROM jsonb_to_recordset(%(reported)s::jsonb) AS p(i int, r int)
    WHERE g.node_id = %(id)s AND g.index = p.i AND g.reported_index IS DISTINCT FROM p.r
"""
# A card the agent now reports under another index than its row's takes no new work: the
# agent starts a task on the index the scheduler gave it, which is another card now. It is
# cordoned (source `renumbered`; a card already cordoned keeps its cordon), and uncordoned
# when the indices agree again (the card that dropped out is back, or replaced) or when an
# operator says so. Its running tasks are left alone, as by any cordon.
GPU_RENUMBERED_CORDON = f"""
    UPDATE gpus SET
        cordoned_at = CASE WHEN reported_index <> index THEN %(now)s END,
        cordon_source = CASE WHEN reported_index <> index THEN '{CordonSource.RENUMBERED}' ELSE '' END,
        cordon_reason = CASE WHEN reported_index <> index
            THEN format('The agent reports this card under index %%s now (its tool renumbered the cards after '
                        || 'one dropped out): a task placed on GPU %%s would start on another card.',
                        reported_index, index)
            ELSE '' END,
        cordon_evidence = CASE WHEN reported_index <> index
            THEN jsonb_build_object('reported_index', reported_index, 'at', %(now)s) ELSE '{{}}'::jsonb END
    WHERE node_id = %(id)s AND (
        (reported_index <> index AND cordoned_at IS NULL)
        OR (cordon_source = '{CordonSource.RENUMBERED}' AND reported_index IS NOT DISTINCT FROM index))
"""

NODE_FOR_UPDATE = "SELECT agent_label_keys, agent_version, agent_git_commit FROM nodes WHERE id = %(id)s FOR UPDATE"
GPU_COUNT_UPDATE = "UPDATE nodes SET gpu_count = (SELECT count(*) FROM gpus WHERE node_id = %(id)s) WHERE id = %(id)s"


# --- parameters -----------------------------------------------------------------------


RECHECK_EVERY_BEATS = 12  # about once a minute at the 5 s beat


def rechecks_alerts(node_id: str, now: datetime, heartbeat_interval: float) -> bool:
    """Whether this beat probes every card for an alert whose condition is over, not only
    the cards whose condition ended in it: one beat in RECHECK_EVERY_BEATS of each node
    (its beats numbered by the clock, the nodes spread by their ids), so an alert a beat
    had to skip is recovered about a minute later."""
    beat_number = int(now.timestamp() // max(heartbeat_interval, 1))
    return (beat_number + zlib.crc32(node_id.encode())) % RECHECK_EVERY_BEATS == 0


def beat_params(node_id: str, payload: dict, peer_ip: str | None, now: datetime) -> dict:
    executable = payload.get("executable", True)
    signed_off_at = now if payload.get("shutting_down") else None
    stats = payload.get("gpu_stats", ())
    readings = []
    for stat in stats:
        sample = {
            "i": stat["index"],
            "a": ",".join(stat.get("metrics_available", [m for m in METRIC_FIELDS if m in stat])),
        }
        for key, name in READING_KEYS:
            sample[key] = reading(stat, name)
        readings.append(sample)
    return {
        "id": node_id,
        "now": now,
        "last_heartbeat_at": now,
        # heard from just now: online or degraded (not executable, or its GPU collector
        # failing as a whole), or offline at once after a farewell (the agent is stopping;
        # its tasks are judged by the usual silence rules, so an agent restart does not
        # disturb them)
        "status": liveness.status_at(
            now, executable, now, signed_off_at=signed_off_at, gpu_failing=bool(payload.get("gpu_collector_error"))
        ),
        "signed_off_at": signed_off_at,
        "ip": peer_ip,
        "internal_ip": payload.get("internal_ip"),
        "internal_prefix": payload.get("internal_prefix"),
        "cpu_used": payload.get("cpu_used"),
        "memory_used": payload.get("memory_used"),
        "gpu_temperature": payload.get("gpu_temperature"),
        "gpu_memory_used_mb": payload.get("gpu_memory_used_mb"),
        "docker_available": payload.get("docker_available", False),
        "executable": executable,
        "exec_mode": payload.get("exec_mode", "docker"),
        "error_message": payload.get("error_message", ""),
        "gpu_collector_error": payload.get("gpu_collector_error", ""),
        "task_health": Jsonb(payload.get("task_health", [])),
        # absent is "not said" (SQL null), never "none alive": the stalled check skips it
        "live_task_ids": Jsonb(payload["live_task_ids"]) if payload.get("live_task_ids") is not None else None,
        "heartbeat_interval": payload.get("heartbeat_interval", 5),
        # the longest interval energy is integrated over: three of the node's beats
        "max_span": 3 * payload.get("heartbeat_interval", 5),
        "idle": float(settings.HETEROFLOW_CPU_IDLE_POWER_FRACTION),
        "updated_at": now,
        "structure_hash": structure_hash(payload),
        "collector_error": bool(payload.get("gpu_collector_error")),
        "failed": [failure["index"] for failure in payload.get("gpu_collect_failures", ())],
        "readings": orjson.dumps(readings).decode(),
        "recheck": rechecks_alerts(node_id, now, payload.get("heartbeat_interval", 5)),
    } | drift.drift_params(payload.get("heartbeat_interval", 5))


def card_facts(stat: dict) -> dict:
    """A card's structural facts as its gpus row keeps them (the model's name normalized)."""
    card = {fact.key: stat.get(fact.key, fact.default) for fact in CARD_FACTS}
    card["model"] = gpu_model(card["vendor"], card["model"], card["memory_total_mb"])
    return card


def placed_cards(payload: dict, placement: card_identity.Placement) -> list[dict]:
    """The beat's cards as their rows keep them: at the row's index, with the index the
    agent reports each under and how each is told apart (apps.nodes.card_identity)."""
    uuids, buses = card_identity.unique_identities(payload)
    basis = payload.get(INDEX_BASIS)
    return [
        card_facts(stat)
        | {
            "index": placement.rows[stat["index"]],
            "reported_index": stat["index"],
            "matched_by": card_identity.identity_kind(stat, basis, uuids=uuids, buses=buses),
        }
        for stat in payload.get("gpu_stats", ())
    ]


def rows_reported(payload: dict, placement: card_identity.Placement) -> list[dict]:
    """GPU_REPORTED_UPDATE's rows: those only a collect failure placed, and the unreported."""
    stats = {stat["index"] for stat in payload.get("gpu_stats", ())}
    failed = [{"i": row, "r": index} for index, row in placement.rows.items() if index not in stats]
    return failed + [{"i": row, "r": None} for row in placement.unreported]


def placed_capabilities(capabilities: dict, placement: card_identity.Placement) -> dict:
    """gpu_capabilities keyed by the cards' rows, not the agent's indices (the same but
    after a renumbering); a key that names no reported card is kept as sent."""
    placed = {}
    for key, value in capabilities.items():
        row = placement.rows.get(int(key)) if key.isdigit() else None
        placed[str(row) if row is not None else key] = value
    return placed


def structure_params(payload: dict, placement: card_identity.Placement | None = None) -> dict:
    """The slow path's parameters: the structural facts as the node's and its cards' rows
    keep them, and what is derived from them. `placement`: where the beat's cards go
    among the node's rows (apps.nodes.card_identity); without it (a node with no rows yet)
    each card goes to its own index."""
    if placement is None:
        placement = card_identity.place([], card_identity.reported_cards(payload))
    params = {
        fact.key: Jsonb(payload.get(fact.key, fact.default)) if fact.json else payload.get(fact.key, fact.default)
        for fact in COPIED_FACTS
    }
    params["mac"] = params["mac"].lower().replace("-", ":")
    params["gpu_capabilities"] = Jsonb(placed_capabilities(payload.get("gpu_capabilities", {}), placement))
    gpus = placed_cards(payload, placement)
    vendors = [card["vendor"] for card in gpus]
    models = {card["model"] for card in gpus}
    return params | {
        "gpu_type": max(set(vendors), key=vendors.count) if vendors else "",
        "gpu_model": models.pop() if len(models) == 1 else ("mixed" if models else ""),
        "cpu_tdp_w_model": energy.cpu_tdp_w_model(params[CPU_MODEL], params[CPU_SOCKETS]),
        "labels": Jsonb(agent_labels(payload)),
        "gpus": orjson.dumps(gpus).decode(),
        "reported": orjson.dumps(rows_reported(payload, placement)).decode(),
    }


def agent_labels(payload: dict) -> dict:
    """The beat's labels, less the cordon label (the operators')."""
    labels = payload.get("labels", {})
    if CORDON_LABEL in labels:
        labels = {key: value for key, value in labels.items() if key != CORDON_LABEL}
    return labels


def label_ownership(payload: dict, previously_owned) -> dict:
    """The slow path's label parameters. An agent that sends `owned_label_keys` owns the
    keys of those it also sends (recorded in `agent_label_keys`); a key it owned before
    and leaves out now is removed. An older agent (no `owned_label_keys`) removes nothing
    and leaves the record as it is: its labels merge as they always did. A key only
    claimed, never sent, is not the agent's: an operator's label is never removed by an
    agent."""
    owned = payload.get("owned_label_keys")
    if owned is None:
        return {"label_removals": [], "agent_label_keys": None}
    sent = set(agent_labels(payload))
    return {
        "label_removals": sorted(set(previously_owned or ()) - sent - {CORDON_LABEL}),
        "agent_label_keys": Jsonb(sorted(sent & set(owned))),
    }


# --- the beat -------------------------------------------------------------------------


def log_version_change(node_id: str, before: tuple[str, str], after: tuple[str, str]) -> None:
    """Every change of a node's agent (version, commit) goes to the server's log: the
    fleet's upgrades and rollbacks, node by node. A "-dirty" commit (built from a tree
    with uncommitted changes) is said so."""
    if tuple(before) == tuple(after):
        return
    dirty = " (built from a tree with uncommitted changes)" if is_dirty_build(after[1]) else ""
    logger.info(
        "node %s: agent %s (%s) -> %s (%s)%s",
        node_id,
        before[0] or "?",
        before[1] or "?",
        after[0] or "?",
        after[1] or "?",
        dirty,
    )


async def ingest(conn, node_id: str, payload: dict, peer_ip: str | None, now: datetime) -> BeatOutcome:
    """Apply one heartbeat. `conn` is in autocommit mode. Any database error propagates
    (the caller answers 503) and leaves nothing written."""
    params = beat_params(node_id, payload, peer_ip, now)
    outcome = BeatOutcome(node_id=node_id, status=params["status"])
    cur = conn.cursor()
    raw = AsyncRawCursor(conn)
    await raw.execute(BEAT_SQL, beat_values(params))
    matched, old_health_hash, changes, outcome.scheduled_task_ids = await raw.fetchone()
    if not matched:
        outcome.slow_path = True
        async with conn.transaction():
            await cur.execute(NODE_FOR_UPDATE, {"id": node_id})
            existing = await cur.fetchone()
            await cur.execute(GPUS_FOR_UPDATE, {"id": node_id})
            rows = [card_identity.Row(*row) for row in await cur.fetchall()]
            placement = card_identity.place(rows, card_identity.reported_cards(payload))
            structure = structure_params(payload, placement) | label_ownership(payload, existing[0] if existing else ())
            if existing is not None:
                log_version_change(node_id, existing[1:], (structure["agent_version"], structure["agent_git_commit"]))
            if existing is None:
                await cur.execute(
                    NODE_INSERT,
                    params
                    | structure
                    | {
                        "agent_label_keys": structure["agent_label_keys"] or Jsonb([]),
                        "name": f"agent-{node_id}",
                        "region": "",
                        "zone": "",
                        "rack": "",
                        "version": 1,
                        "registered_at": now,
                        "gpu_count": 0,
                    },
                )
                outcome.registered = cur.rowcount == 1
                if not outcome.registered:  # a concurrent first beat won the insert
                    await cur.execute(FULL_NODE_UPDATE, params | structure)
            else:
                await cur.execute(FULL_NODE_UPDATE, params | structure)
            await cur.execute(GPU_UPSERT, {"id": node_id, "now": now, "gpus": structure["gpus"]})
            await cur.execute(GPU_REPORTED_UPDATE, {"id": node_id, "reported": structure["reported"]})
            await cur.execute(GPU_RENUMBERED_CORDON, {"id": node_id, "now": now})
            await cur.execute(GPU_COUNT_UPDATE, {"id": node_id})
            # The structure now matches: the beat itself is the same statement as always.
            await raw.execute(BEAT_SQL, beat_values(params))
            matched, old_health_hash, changes, outcome.scheduled_task_ids = await raw.fetchone()
            if not matched:
                raise RuntimeError(f"heartbeat of {node_id}: the node row did not match after the slow path")
    if "gpu_health" in payload:  # an older agent sends none: its cards' health stays unknown
        beat_health_hash = health.readings_hash(payload["gpu_health"])
        if beat_health_hash != old_health_hash:
            outcome.health_changed = True
            await health.apply_beat_health(cur, node_id, payload["gpu_health"], beat_health_hash, now)
    outcome.gpu_changes = [GpuChange(*change) for change in changes]
    return outcome
