"""Card health: what the agent reads of each card's errors (ECC counters, retired and
remapped pages, Xid events, hardware throttle reasons), kept per card and judged.

The heartbeat calls `apply_beat_health` only when the beat's `gpu_health` differs from
the last one the node sent (its hash, `nodes.health_hash`): the readings change rarely,
so the steady beat pays nothing for them. A reading is stored on the card (`gpus.health`)
and, when it changed, as a sample in the long-lived history (gpu_health_samples) that
failure prediction reads. A field the vendor's tool cannot read is absent (never 0).

Each changed reading is judged against the card's previous one (`judge`, a pure
function). An unhealthy card is cordoned (no new placement; its running tasks are left
alone), its sample is marked unhealthy with the reasons, and GPU_UNHEALTHY is raised
with the evidence, in the health step's own transaction: raw SQL on the heartbeat's
psycopg cursor, no ORM. The alert reaches the notification channels through the outbox
(apps.alerts.notifications.dispatch), which takes every alert from the table however it
was raised. Recovery (an operator, or the clean period) is apps.nodes.gpu_health_services.
docs/gpu-health.md.
"""

from __future__ import annotations

import hashlib
from datetime import datetime

import orjson
from django.conf import settings
from psycopg.types.json import Jsonb

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.nodes.choices import CordonSource

# The counters and flags of one card's reading, as the agent names them (protocol:
# heartbeat.schema.json, gpu_health) and as gpu_health_samples' columns are named.
COUNTERS = (
    "ecc_corrected_volatile",
    "ecc_uncorrected_volatile",
    "ecc_corrected_aggregate",
    "ecc_uncorrected_aggregate",
    "retired_pages_single_bit",
    "retired_pages_double_bit",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
)
FLAGS = ("retired_pages_pending", "remapped_rows_pending", "remapped_rows_failure")


def readings_hash(readings: list[dict]) -> str:
    document = orjson.dumps(readings, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(document, digest_size=16).hexdigest()


# --- the judgement ---------------------------------------------------------------------

# Counters whose growth (compared with the card's previous reading) makes a card unhealthy;
# the uncorrected ECC counts also on first sight, when the card already shows some.
BAD_WHEN_GROWN = (
    "ecc_uncorrected_volatile",
    "ecc_uncorrected_aggregate",
    "retired_pages_double_bit",
    "remapped_rows_uncorrectable",
)
BAD_ON_FIRST_SIGHT = ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate")
# Flags that make a card unhealthy when they turn true (or are true on first sight).
BAD_WHEN_SET = ("remapped_rows_failure",)
# Evidence that is not a cordon but ranks a card higher on the health page.
PENDING_FLAGS = ("retired_pages_pending", "remapped_rows_pending")
CORRECTED = ("ecc_corrected_volatile", "ecc_corrected_aggregate")
UNCORRECTED = ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate")

LABELS = {
    "ecc_uncorrected_volatile": "uncorrected ECC errors (volatile)",
    "ecc_uncorrected_aggregate": "uncorrected ECC errors (aggregate)",
    "retired_pages_double_bit": "pages retired for double-bit errors",
    "remapped_rows_uncorrectable": "rows remapped for uncorrectable errors",
    "remapped_rows_failure": "row remapping failed",
}


def judge(previous: dict | None, reading: dict, fatal_xids) -> list[dict]:
    """Why `reading` shows an unhealthy card, compared with the card's `previous` reading
    (None or {} on first sight); [] when it does not. Each reason is its evidence:
    `{"kind": "counter", "field", "before", "after", "message"}`,
    `{"kind": "flag", "field", "before", "after", "message"}` or
    `{"kind": "xid", "code", "text", "at", "message"}`. A field absent from either
    reading (the tool cannot read it) is no evidence either way."""
    previous = previous or {}
    fatal = set(fatal_xids)
    reasons: list[dict] = []
    for name in BAD_WHEN_GROWN:
        after = reading.get(name)
        if not isinstance(after, int):
            continue
        before = previous.get(name)
        if isinstance(before, int):
            grown = after > before
        else:
            grown = name in BAD_ON_FIRST_SIGHT and after > 0
        if grown:
            shown = "—" if before is None else before
            reasons.append(
                {
                    "kind": "counter",
                    "field": name,
                    "before": before,
                    "after": after,
                    "message": f"{LABELS[name]}: {shown} → {after}",
                }
            )
    for name in BAD_WHEN_SET:
        if reading.get(name) is True and previous.get(name) is not True:
            reasons.append(
                {
                    "kind": "flag",
                    "field": name,
                    "before": previous.get(name),
                    "after": True,
                    "message": LABELS[name],
                }
            )
    for event in new_xid_events(previous, reading):
        code = event.get("code")
        if code in fatal:
            text = str(event.get("text") or "")
            at = event.get("at")
            reasons.append(
                {
                    "kind": "xid",
                    "code": code,
                    "text": text,
                    "at": at,
                    "message": f"Xid {code}" + (f" ({text})" if text else "") + (f" at {at}" if at else ""),
                }
            )
    return reasons


def cordon_reason(reasons: list[dict]) -> str:
    """The one-line reason a health cordon keeps (gpus.cordon_reason, 300 characters)."""
    text = "unhealthy: " + "; ".join(reason["message"] for reason in reasons)
    return text if len(text) <= 300 else text[:299] + "…"


EVIDENCE_KEPT = 20  # the reasons a card's cordon evidence keeps, newest last


def merged_evidence(stored: dict | None, reasons: list[dict], now: datetime) -> dict:
    """The card's cordon evidence after this judgement: the time of the first and of the
    latest bad reading, and the reasons of all of them (the latest EVIDENCE_KEPT)."""
    stored = stored or {}
    at = now.isoformat().replace("+00:00", "Z")
    dated = [reason | {"seen_at": at} for reason in reasons]
    return {
        "first_at": stored.get("first_at") or at,
        "latest_at": at,
        "reasons": (list(stored.get("reasons", [])) + dated)[-EVIDENCE_KEPT:],
    }


# --- the beat's health step ---------------------------------------------------------------

# The lock order of every writer of node and card rows (docs/architecture.md#lock-order):
# the node's row first, then its cards by index.
NODE = "SELECT 1 FROM nodes WHERE id = %(id)s FOR NO KEY UPDATE"
# A card's reading is the one the beat sent under the index the agent reports the card
# under now (`reported_index`: the row's own index unless the tool renumbered its cards;
# apps.nodes.card_identity); a card the beat left out has none.
CARDS = (
    "SELECT index, reported_index, uuid, vendor, model, health, cordon_evidence FROM gpus WHERE node_id = %(id)s "
    "ORDER BY index FOR UPDATE"
)
# A card already cordoned (by an earlier judgement or an operator) keeps its cordon: its
# time, source and reason; the evidence and last_bad_at follow the latest bad reading.
CORDON = f"""
    UPDATE gpus SET
        cordon_source = CASE WHEN cordoned_at IS NULL THEN '{CordonSource.HEALTH.value}' ELSE cordon_source END,
        cordon_reason = CASE WHEN cordoned_at IS NULL THEN %(reason)s ELSE cordon_reason END,
        cordoned_at = COALESCE(cordoned_at, %(now)s),
        cordon_evidence = %(evidence)s, last_bad_at = %(now)s
    WHERE node_id = %(id)s AND index = %(index)s
"""
RAISE = f"""
    INSERT INTO alerts (type, severity, scope, state, key, node_id, gpu_index, message, details, created_at, updated_at)
    VALUES ('{AlertType.GPU_UNHEALTHY}', '{Severity.ERROR}', '{AlertScope.GPU}', 'ACTIVE', %(key)s, %(id)s, %(index)s,
            %(message)s, %(details)s, %(now)s, %(now)s)
    ON CONFLICT (key) WHERE state = 'ACTIVE' DO NOTHING
"""
STORE = "UPDATE gpus SET health = %(health)s, health_at = %(now)s WHERE node_id = %(id)s AND index = %(index)s"
SAMPLE = (
    "INSERT INTO gpu_health_samples (node_id, gpu_index, gpu_uuid, vendor, model, at, "
    + ", ".join(COUNTERS + FLAGS)
    + ", xid_events, throttle_reasons, available, unhealthy, reasons) VALUES (%(id)s, %(index)s, %(uuid)s, "
    "%(vendor)s, %(model)s, %(now)s, "
    + ", ".join(f"%({name})s" for name in COUNTERS + FLAGS)
    + ", %(xid_events)s, %(throttle_reasons)s, %(available)s, %(unhealthy)s, %(reasons)s)"
)
HASH = "UPDATE nodes SET health_hash = %(hash)s WHERE id = %(id)s"


# The agent dates a kernel-log record as its boot time plus the record's time since boot,
# to the second, and works the boot time out again when it restarts: the same event may
# come back a second off. Within this many seconds, same code and text: the same event.
XID_SAME_EVENT_SECONDS = 2


def _xid_moment(event: dict) -> float | None:
    try:
        return datetime.fromisoformat(str(event.get("at")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def new_xid_events(before: dict, now: dict) -> list[dict]:
    """The Xid events of this reading that the card's previous reading did not have (an
    event is its code, text and moment; a moment a second or two off is the same event,
    re-dated by an agent restart)."""
    seen: dict[tuple, list[float | None]] = {}
    for event in before.get("xid_events", ()):
        seen.setdefault((event.get("code"), event.get("text", "")), []).append(_xid_moment(event))

    def known(event: dict) -> bool:
        moment = _xid_moment(event)
        for other in seen.get((event.get("code"), event.get("text", "")), ()):
            if moment is None or other is None:
                if moment is other:
                    return True
            elif abs(moment - other) <= XID_SAME_EVENT_SECONDS:
                return True
        return False

    return [event for event in now.get("xid_events", ()) if not known(event)]


async def apply_beat_health(cur, node_id: str, readings: list[dict], readings_hash_: str, now: datetime) -> None:
    """Store the cards' changed readings and their samples, judge each against the card's
    previous reading and cordon the unhealthy ones (with GPU_UNHEALTHY), then the node's
    hash, in one transaction (the hash last: a failure leaves the old hash, so the next
    beat retries)."""
    by_index = {reading["index"]: reading for reading in readings if isinstance(reading.get("index"), int)}
    fatal_xids = settings.HETEROFLOW_GPU_FATAL_XIDS
    async with cur.connection.transaction():
        await cur.execute(NODE, {"id": node_id})
        await cur.execute(CARDS, {"id": node_id})
        for index, reported_index, uuid, vendor, model, stored, evidence in await cur.fetchall():
            reading = by_index.get(reported_index)
            if reading is None or reading == stored:
                continue
            reasons = judge(stored, reading, fatal_xids)
            params = {"id": node_id, "index": index, "now": now}
            await cur.execute(STORE, params | {"health": Jsonb(reading)})
            await cur.execute(
                SAMPLE,
                params
                | {name: reading.get(name) for name in COUNTERS + FLAGS}
                | {
                    "uuid": uuid,
                    "vendor": vendor,
                    "model": model,
                    "xid_events": Jsonb(new_xid_events(stored or {}, reading)),
                    "throttle_reasons": Jsonb(reading["throttle_reasons"]) if "throttle_reasons" in reading else None,
                    "available": Jsonb(reading.get("available", [])),
                    "unhealthy": bool(reasons),
                    "reasons": Jsonb(reasons),
                },
            )
            if reasons:
                reason = cordon_reason(reasons)
                await cur.execute(
                    CORDON, params | {"reason": reason, "evidence": Jsonb(merged_evidence(evidence, reasons, now))}
                )
                await cur.execute(
                    RAISE,
                    params
                    | {
                        "key": alert_keys.gpu_unhealthy(node_id, index),
                        "message": f"GPU {index} of node {node_id} is unhealthy and cordoned: {reason}",
                        "details": Jsonb({"reasons": reasons, "uuid": uuid, "model": model}),
                    },
                )
        await cur.execute(HASH, {"id": node_id, "hash": readings_hash_})
