"""Heartbeat ingestion: the hottest path of the control plane.

A steady-state beat costs three statements in one transaction, whatever the cluster
size: a narrow UPDATE of the node's heartbeat columns (guarded by the structure hash),
one UPDATE of all the node's GPU rows from arrays (readings plus the lost-card
judgement), and one INSERT of the metrics sample. A beat whose structure changed (GPU
models, specs, labels, agent version…) or a first beat takes the slow path, which is
rare. Nothing here reads another node.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, field
from datetime import datetime

import orjson
from psycopg.types.json import Jsonb

from apps.alerts.choices import AlertType, Severity
from apps.alerts.sql import RAISE_ALERT_SQL, RECOVER_ALERT_SQL, raise_alert_params
from apps.nodes.choices import LOST_AFTER_BEATS, RECOVERED_AFTER_BEATS, NodeStatus
from apps.nodes.normalize import gpu_model

# Facts whose change takes the slow path (a full-row update and GPU upserts).
STRUCTURAL_KEYS = (
    "hostname", "os", "cpu_cores", "memory_gb", "mac", "is_container", "agent_version",
    "agent_git_commit", "agent_build_time", "gpu_capabilities", "labels", "vllm_available",
    "inference_engines", "inference_engine_versions", "discovered_models",
)
METRIC_FIELDS = ("utilization", "memory_used_mb", "temperature", "power_w")
BASIS_NAMES = {1: "heartbeat_absent", 2: "agent_collect_failure", 3: "mixed"}


def structure_hash(payload: dict) -> str:
    gpus = sorted(
        (g["index"], g.get("uuid", ""), g["vendor"], g.get("model", ""), g.get("memory_total_mb"), g.get("compute_capability", ""))
        for g in payload.get("gpu_stats", ())
    )
    document = orjson.dumps([[payload.get(key) for key in STRUCTURAL_KEYS], gpus], option=orjson.OPT_SORT_KEYS)
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


@dataclass
class BeatOutcome:
    node_id: str
    status: str
    registered: bool = False
    slow_path: bool = False
    ip_changed: bool = False
    gpu_changes: list[GpuChange] = field(default_factory=list)


# --- statements -----------------------------------------------------------------------

HEARTBEAT_COLUMNS = (
    "last_heartbeat_at", "status", "ip", "internal_ip", "cpu_used", "memory_used", "gpu_temperature",
    "gpu_memory_used_mb", "docker_available", "executable", "exec_mode", "error_message",
    "gpu_collector_error", "task_health", "live_task_ids", "heartbeat_interval", "updated_at",
)

FAST_NODE_UPDATE = (
    "UPDATE nodes AS n SET "
    + ", ".join(f"{column} = %({column})s" for column in HEARTBEAT_COLUMNS)
    + " FROM (SELECT id, ip AS old_ip FROM nodes WHERE id = %(id)s) AS o"
    " WHERE n.id = o.id AND n.structure_hash = %(structure_hash)s RETURNING o.old_ip"
)

STRUCTURE_COLUMNS = (
    "hostname", "os", "cpu_cores", "memory_gb", "mac", "is_container", "agent_version", "agent_git_commit",
    "agent_build_time", "gpu_capabilities", "vllm_available", "inference_engines", "inference_engine_versions",
    "discovered_models", "gpu_type", "gpu_model", "structure_hash",
)

FULL_NODE_UPDATE = (
    "UPDATE nodes SET "
    + ", ".join(f"{column} = %({column})s" for column in HEARTBEAT_COLUMNS + STRUCTURE_COLUMNS)
    + ", labels = labels || %(labels)s WHERE id = %(id)s"
)

NODE_INSERT_COLUMNS = HEARTBEAT_COLUMNS + STRUCTURE_COLUMNS + (
    "id", "name", "labels", "region", "zone", "rack", "version", "registered_at", "gpu_count",
)
NODE_INSERT = (
    f"INSERT INTO nodes ({', '.join(NODE_INSERT_COLUMNS)}) VALUES ("
    + ", ".join(f"%({column})s" for column in NODE_INSERT_COLUMNS)
    + ") ON CONFLICT (id) DO NOTHING"
)

GPU_UPSERT = """
    INSERT INTO gpus (node_id, index, uuid, vendor, model, memory_total_mb, compute_capability, metrics_available,
                      absent_streak, absent_basis, present_streak, lost_basis, updated_at)
    SELECT %(node_id)s, u.idx, u.uuid, u.vendor, u.model, u.mem_total, u.cc, '[]'::jsonb, 0, 0, 0, '', %(now)s
    FROM unnest(%(idx)s::int[], %(uuid)s::text[], %(vendor)s::text[], %(model)s::text[], %(mem_total)s::bigint[], %(cc)s::text[])
         AS u(idx, uuid, vendor, model, mem_total, cc)
    ON CONFLICT (node_id, index) DO UPDATE SET
        uuid = EXCLUDED.uuid, vendor = EXCLUDED.vendor, model = EXCLUDED.model,
        memory_total_mb = EXCLUDED.memory_total_mb, compute_capability = EXCLUDED.compute_capability
"""

GPU_COUNT_UPDATE = "UPDATE nodes SET gpu_count = (SELECT count(*) FROM gpus WHERE node_id = %(id)s) WHERE id = %(id)s"

# Readings for every registered GPU of the node plus the lost-card judgement, in one
# statement. `s` is the pre-update snapshot, so RETURNING can compare old and new.
GPU_BEAT_UPDATE = f"""
    UPDATE gpus AS g SET
        utilization = s.util, memory_used_mb = s.mem_used, temperature = s.temp, power_w = s.power,
        metrics_available = COALESCE(to_jsonb(string_to_array(NULLIF(s.avail, ''), ',')), '[]'::jsonb),
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
        updated_at = %(now)s
    FROM (
        SELECT g2.id, g2.lost_at IS NOT NULL AS was_lost,
               CASE WHEN %(collector_error)s THEN 'skip'
                    WHEN g2.index = ANY(%(failed)s::int[]) THEN 'failed'
                    WHEN b.idx IS NULL THEN 'absent'
                    ELSE 'present' END AS kind,
               b.util, b.mem_used, b.temp, b.power, b.avail
        FROM gpus AS g2
        LEFT JOIN unnest(%(idx)s::int[], %(util)s::float8[], %(mem_used)s::bigint[], %(temp)s::float8[],
                         %(power)s::float8[], %(avail)s::text[]) AS b(idx, util, mem_used, temp, power, avail)
               ON b.idx = g2.index AND NOT (g2.index = ANY(%(failed)s::int[]))
        WHERE g2.node_id = %(node_id)s
    ) AS s
    WHERE g.id = s.id
    RETURNING g.index, s.was_lost, g.lost_at IS NOT NULL AS is_lost, g.lost_basis
"""

METRIC_INSERT = (
    "INSERT INTO node_metrics (node_id, at, cpu_used, memory_used, gpus) "
    "VALUES (%(node_id)s, %(now)s, %(cpu_used)s, %(memory_used)s, %(gpus)s)"
)


# --- parameters -----------------------------------------------------------------------


def heartbeat_params(node_id: str, payload: dict, peer_ip: str | None, now: datetime) -> dict:
    executable = payload.get("executable", True)
    return {
        "id": node_id,
        "last_heartbeat_at": now,
        "status": NodeStatus.ONLINE if executable else NodeStatus.DEGRADED,
        "ip": peer_ip,
        "internal_ip": payload.get("internal_ip"),
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
        "live_task_ids": Jsonb(payload.get("live_task_ids", [])),
        "heartbeat_interval": payload.get("heartbeat_interval", 5),
        "updated_at": now,
        "structure_hash": structure_hash(payload),
    }


def structure_params(payload: dict) -> dict:
    stats = payload.get("gpu_stats", ())
    vendors = [g["vendor"] for g in stats]
    models = {gpu_model(g["vendor"], g.get("model", ""), g.get("memory_total_mb")) for g in stats}
    return {
        "hostname": payload.get("hostname", ""),
        "os": payload.get("os", ""),
        "cpu_cores": payload.get("cpu_cores"),
        "memory_gb": payload.get("memory_gb"),
        "mac": payload.get("mac", "").lower().replace("-", ":"),
        "is_container": payload.get("is_container", False),
        "agent_version": payload.get("agent_version", ""),
        "agent_git_commit": payload.get("agent_git_commit", ""),
        "agent_build_time": payload.get("agent_build_time", ""),
        "gpu_capabilities": Jsonb(payload.get("gpu_capabilities", {})),
        "vllm_available": payload.get("vllm_available", False),
        "inference_engines": Jsonb(payload.get("inference_engines", [])),
        "inference_engine_versions": Jsonb(payload.get("inference_engine_versions", {})),
        "discovered_models": Jsonb(payload.get("discovered_models", [])),
        "gpu_type": max(set(vendors), key=vendors.count) if vendors else "",
        "gpu_model": models.pop() if len(models) == 1 else ("mixed" if models else ""),
        "labels": Jsonb(payload.get("labels", {})),
    }


def gpu_params(node_id: str, payload: dict, now: datetime) -> dict:
    stats = [g for g in payload.get("gpu_stats", ())]
    return {
        "node_id": node_id,
        "now": now,
        "collector_error": bool(payload.get("gpu_collector_error")),
        "failed": [f["index"] for f in payload.get("gpu_collect_failures", ())],
        "idx": [g["index"] for g in stats],
        "uuid": [g.get("uuid", "") for g in stats],
        "vendor": [g["vendor"] for g in stats],
        "model": [gpu_model(g["vendor"], g.get("model", ""), g.get("memory_total_mb")) for g in stats],
        "mem_total": [g.get("memory_total_mb") for g in stats],
        "cc": [g.get("compute_capability", "") for g in stats],
        "util": [reading(g, "utilization") for g in stats],
        "mem_used": [reading(g, "memory_used_mb") for g in stats],
        "temp": [reading(g, "temperature") for g in stats],
        "power": [reading(g, "power_w") for g in stats],
        "avail": [",".join(g.get("metrics_available", [m for m in METRIC_FIELDS if m in g])) for g in stats],
    }


def metric_params(node_id: str, payload: dict, gpus: dict, now: datetime) -> dict:
    samples = []
    for position, index in enumerate(gpus["idx"]):
        if index in gpus["failed"]:
            continue
        sample = {"i": index}
        for key, column in (("u", "util"), ("m", "mem_used"), ("t", "temp"), ("p", "power")):
            value = gpus[column][position]
            if value is not None:
                sample[key] = value
        samples.append(sample)
    return {
        "node_id": node_id,
        "now": now,
        "cpu_used": payload.get("cpu_used"),
        "memory_used": payload.get("memory_used"),
        "gpus": Jsonb(samples),
    }


def same_address(stored, peer: str | None) -> bool:
    """psycopg returns inet columns as ipaddress objects; compare as addresses."""
    if stored is None or peer is None:
        return stored is None and peer is None
    try:
        return ipaddress.ip_address(str(stored)) == ipaddress.ip_address(peer)
    except ValueError:
        return False


# --- the transaction ------------------------------------------------------------------


async def ingest(conn, node_id: str, payload: dict, peer_ip: str | None, now: datetime) -> BeatOutcome:
    """Apply one heartbeat in one transaction. Any database error propagates (the caller
    answers 503) and leaves nothing written."""
    beat = heartbeat_params(node_id, payload, peer_ip, now)
    gpus = gpu_params(node_id, payload, now)
    outcome = BeatOutcome(node_id=node_id, status=beat["status"])
    async with conn.transaction():
        cur = conn.cursor()
        await cur.execute(FAST_NODE_UPDATE, beat)
        row = await cur.fetchone()
        if row is not None:
            outcome.ip_changed = not same_address(row[0], peer_ip)
        else:
            outcome.slow_path = True
            await cur.execute("SELECT ip FROM nodes WHERE id = %s FOR UPDATE", [node_id])
            existing = await cur.fetchone()
            structure = structure_params(payload)
            if existing is None:
                await cur.execute(NODE_INSERT, beat | structure | {
                    "name": f"agent-{node_id}", "region": "", "zone": "", "rack": "", "version": 1,
                    "registered_at": now, "gpu_count": 0,
                })
                outcome.registered = cur.rowcount == 1
                if not outcome.registered:  # a concurrent first beat won the insert
                    await cur.execute(FULL_NODE_UPDATE, beat | structure)
            else:
                outcome.ip_changed = not same_address(existing[0], peer_ip)
                await cur.execute(FULL_NODE_UPDATE, beat | structure)
            if gpus["idx"]:
                await cur.execute(GPU_UPSERT, gpus)
            await cur.execute(GPU_COUNT_UPDATE, {"id": node_id})
        await cur.execute(GPU_BEAT_UPDATE, gpus)
        for index, was_lost, is_lost, basis in await cur.fetchall():
            if was_lost != is_lost:
                outcome.gpu_changes.append(GpuChange(index, is_lost, basis))
        await cur.execute(METRIC_INSERT, metric_params(node_id, payload, gpus, now))
        for change in outcome.gpu_changes:
            key = f"GPU_LOST:{node_id}:{change.index}"
            if change.lost:
                await cur.execute(RAISE_ALERT_SQL, raise_alert_params(
                    type=AlertType.GPU_LOST, severity=Severity.ERROR, key=key, node_id=node_id, gpu_index=change.index,
                    message=f"GPU {change.index} of node {node_id} is lost ({change.basis}).",
                    details={"basis": change.basis},
                ))
            else:
                await cur.execute(RECOVER_ALERT_SQL, [key])
    return outcome
