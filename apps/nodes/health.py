"""Card health: what the agent reads of each card's errors (ECC counters, retired and
remapped pages, Xid events, hardware throttle reasons), kept per card and judged.

The heartbeat calls `apply_beat_health` only when the beat's `gpu_health` differs from
the last one the node sent (its hash, `nodes.health_hash`): the readings change rarely,
so the steady beat pays nothing for them. A reading is stored on the card (`gpus.health`)
and, when it changed, as a sample in the long-lived history (gpu_health_samples) that
failure prediction reads. A field the vendor's tool cannot read is absent (never 0).
"""

from __future__ import annotations

import hashlib
from datetime import datetime

import orjson
from psycopg.types.json import Jsonb

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


CARDS = "SELECT index, uuid, vendor, model, health FROM gpus WHERE node_id = %(id)s FOR UPDATE"
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


def new_xid_events(before: dict, now: dict) -> list[dict]:
    """The Xid events of this reading that the card's previous reading did not have."""
    seen = {(event.get("code"), event.get("at")) for event in before.get("xid_events", ())}
    return [event for event in now.get("xid_events", ()) if (event.get("code"), event.get("at")) not in seen]


async def apply_beat_health(cur, node_id: str, readings: list[dict], readings_hash_: str, now: datetime) -> None:
    """Store the cards' changed readings and their samples, then the node's hash, in one
    transaction (the hash last: a failure leaves the old hash, so the next beat retries)."""
    by_index = {reading["index"]: reading for reading in readings if isinstance(reading.get("index"), int)}
    async with cur.connection.transaction():
        await cur.execute(CARDS, {"id": node_id})
        for index, uuid, vendor, model, stored in await cur.fetchall():
            reading = by_index.get(index)
            if reading is None or reading == stored:
                continue
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
                    "unhealthy": False,
                    "reasons": Jsonb([]),
                },
            )
        await cur.execute(HASH, {"id": node_id, "hash": readings_hash_})
