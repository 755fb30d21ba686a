"""Energy: the CPU model table behind the node's CPU power estimate, and the daily
rollup of the energy accumulators.

The accumulators themselves are written by the heartbeat's one statement
(apps.nodes.heartbeat, BEAT): per card `gpus.energy_wh`, the trapezoid of two measured
power readings over the beat's real interval; per node `nodes.cpu_energy_wh_estimate`,
the same over the CPU power estimate (TDP × (idle + (1 − idle) × cpu_used / 100)). A
longer interval than three of the node's beats, or a reading missing at either end, is a
gap: no energy is invented for it (a card's gaps are counted in
`gpus.energy_gap_seconds`).

The accumulators only grow, and are not bounded by the metrics retention. The rollup
(`roll_up_energy`, a periodic job) adds each accumulator's growth since the previous
rollup to `energy_daily` for the current UTC day, so trends outlive the metrics window.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from django.db import connection

from apps.core.clock import utcnow
from apps.nodes.models import EnergyDaily

# --- the CPU model table ----------------------------------------------------------------

# TDP per socket, in watts, of common server CPUs, keyed by (family, SKU). The figures are
# the vendors' spec pages' "TDP" (Intel ark.intel.com "TDP"; AMD amd.com product pages
# "Default TDP"), and for Kunpeng and Hygon, which publish no per-SKU spec pages in
# English, the figures WikiChip gives (en.wikichip.org, hisilicon/kunpeng/920-*) and, for
# Hygon, the EPYC part each SKU is built from. A CPU not here has no model TDP (null):
# the operator sets the node's cpu_tdp_w, and until then there is no CPU estimate.
CPU_TDP_W = {
    # Intel Xeon Scalable, 1st gen (Skylake-SP, 2017)
    ("xeon", "8180"): 205,
    ("xeon", "8176"): 165,
    ("xeon", "8168"): 205,
    ("xeon", "8160"): 150,
    ("xeon", "6154"): 200,
    ("xeon", "6148"): 150,
    ("xeon", "6130"): 125,
    ("xeon", "5118"): 105,
    ("xeon", "4114"): 85,
    ("xeon", "4116"): 85,
    # 2nd gen (Cascade Lake, 2019-2020)
    ("xeon", "8280"): 205,
    ("xeon", "8268"): 205,
    ("xeon", "8260"): 165,
    ("xeon", "6258R"): 205,
    ("xeon", "6248R"): 205,
    ("xeon", "6248"): 150,
    ("xeon", "6240"): 150,
    ("xeon", "6230"): 125,
    ("xeon", "6226R"): 150,
    ("xeon", "5220"): 125,
    ("xeon", "5218"): 125,
    ("xeon", "4214"): 85,
    ("xeon", "4210"): 85,
    ("xeon", "4210R"): 100,
    # 3rd gen (Ice Lake-SP, 2021)
    ("xeon", "8380"): 270,
    ("xeon", "8368"): 270,
    ("xeon", "8358"): 250,
    ("xeon", "8352Y"): 205,
    ("xeon", "6348"): 235,
    ("xeon", "6338"): 205,
    ("xeon", "6330"): 205,
    ("xeon", "5318Y"): 165,
    ("xeon", "4314"): 135,
    ("xeon", "4310"): 120,
    # 4th gen (Sapphire Rapids, 2023)
    ("xeon", "8480+"): 350,
    ("xeon", "8470"): 350,
    ("xeon", "8468"): 350,
    ("xeon", "8462Y+"): 300,
    ("xeon", "6448Y"): 225,
    ("xeon", "6430"): 270,
    ("xeon", "5418Y"): 185,
    ("xeon", "4410Y"): 150,
    # 5th gen (Emerald Rapids, 2023)
    ("xeon", "8592+"): 350,
    ("xeon", "8580"): 350,
    ("xeon", "8558"): 330,
    ("xeon", "6548Y+"): 250,
    ("xeon", "6530"): 270,
    # Xeon 6 (Granite Rapids, 2024)
    ("xeon", "6980P"): 500,
    ("xeon", "6960P"): 500,
    # AMD EPYC 7001 (Naples, 2017)
    ("epyc", "7601"): 180,
    ("epyc", "7551"): 180,
    ("epyc", "7451"): 180,
    # EPYC 7002 (Rome, 2019)
    ("epyc", "7H12"): 280,
    ("epyc", "7742"): 225,
    ("epyc", "7702"): 200,
    ("epyc", "7642"): 225,
    ("epyc", "7542"): 225,
    ("epyc", "7502"): 180,
    ("epyc", "7452"): 155,
    ("epyc", "7402"): 180,
    ("epyc", "7302"): 155,
    ("epyc", "7282"): 120,
    # EPYC 7003 (Milan, 2021)
    ("epyc", "7763"): 280,
    ("epyc", "7773X"): 280,
    ("epyc", "7713"): 225,
    ("epyc", "7663"): 240,
    ("epyc", "75F3"): 280,
    ("epyc", "7543"): 225,
    ("epyc", "7513"): 200,
    ("epyc", "74F3"): 240,
    ("epyc", "7453"): 225,
    ("epyc", "7443"): 200,
    ("epyc", "7413"): 180,
    ("epyc", "7343"): 190,
    ("epyc", "7313"): 155,
    # EPYC 9004 (Genoa, Genoa-X, Bergamo; 2022-2023)
    ("epyc", "9654"): 360,
    ("epyc", "9684X"): 400,
    ("epyc", "9754"): 360,
    ("epyc", "9554"): 360,
    ("epyc", "9474F"): 360,
    ("epyc", "9454"): 290,
    ("epyc", "9354"): 280,
    ("epyc", "9334"): 210,
    ("epyc", "9254"): 200,
    ("epyc", "9124"): 200,
    # EPYC 9005 (Turin, 2024)
    ("epyc", "9965"): 500,
    ("epyc", "9755"): 500,
    ("epyc", "9655"): 400,
    ("epyc", "9575F"): 400,
    ("epyc", "9555"): 360,
    ("epyc", "9455"): 300,
    ("epyc", "9355"): 280,
    # HiSilicon Kunpeng 920 (WikiChip)
    ("kunpeng", "6426"): 180,
    ("kunpeng", "4826"): 150,
    # Hygon C86 (Dhyana): 7185 is the 32-core part of the EPYC 7551's design (180 W);
    # 3185 the 8-core part, 95 W as reported with the parts
    ("hygon", "7185"): 180,
    ("hygon", "3185"): 95,
}

_CPU_PATTERNS = (
    # "Intel(R) Xeon(R) Platinum 8480+", "Intel(R) Xeon(R) Gold 6248R CPU @ 3.00GHz",
    # "Intel(R) Xeon(R) 6980P"
    ("xeon", re.compile(r"\bXEON(?:\(R\))?\s+(?:(?:PLATINUM|GOLD|SILVER|BRONZE)\s+)?(\d{4}[A-Z]*\+?)")),
    # "AMD EPYC 7763 64-Core Processor", "AMD EPYC 7H12 64-Core Processor"
    ("epyc", re.compile(r"\bEPYC\s+(\d[0-9A-Z]{3}[A-Z]*)\b")),
    # "Kunpeng 920-6426", "HUAWEI Kunpeng 920 4826"
    ("kunpeng", re.compile(r"\bKUNPENG[\s-]*920[\s-]+(\d{4}[A-Z]?)\b")),
    # "Hygon C86 7185 32-core Processor"
    ("hygon", re.compile(r"\bHYGON\s+C86[\s-]+(\d{4})\b")),
)


def cpu_sku(model: str) -> tuple[str, str] | None:
    """The (family, SKU) of a CPU's model name as /proc/cpuinfo spells it, or None."""
    name = (model or "").upper()
    for family, pattern in _CPU_PATTERNS:
        match = pattern.search(name)
        if match:
            return family, match.group(1)
    return None


def cpu_tdp_w_model(model: str, sockets: int | None) -> float | None:
    """The node's CPU TDP from the model table (per socket × sockets), or None when the
    model is not in the table or the number of sockets is not known."""
    sku = cpu_sku(model)
    tdp = CPU_TDP_W.get(sku) if sku else None
    if tdp is None or not sockets:
        return None
    return float(tdp * sockets)


# --- the daily rollup -------------------------------------------------------------------

# One statement. Each accumulator (a card's energy_wh once it has a measured reading, a
# node's CPU estimate once it has one) against the meter of its latest energy_daily row:
# the growth is added to today's row. An accumulator below its meter was re-created (a
# card row removed and registered again): it counts from zero, so its whole value is the
# growth, never a negative one. An accumulator that did not move writes nothing.
ROLLUP = f"""
WITH meters AS (
    SELECT node_id, index AS gpu_index, energy_wh AS wh FROM gpus WHERE energy_since IS NOT NULL
    UNION ALL
    SELECT id, {EnergyDaily.CPU_ESTIMATE}, cpu_energy_wh_estimate FROM nodes WHERE cpu_power_at IS NOT NULL
), growth AS (
    SELECT m.node_id, m.gpu_index, m.wh,
           CASE WHEN l.meter_wh IS NULL OR m.wh < l.meter_wh THEN m.wh ELSE m.wh - l.meter_wh END AS delta
    FROM meters AS m
    LEFT JOIN LATERAL (
        SELECT d.meter_wh FROM energy_daily AS d
        WHERE d.node_id = m.node_id AND d.gpu_index = m.gpu_index ORDER BY d.day DESC LIMIT 1
    ) AS l ON true
    WHERE l.meter_wh IS DISTINCT FROM m.wh
)
INSERT INTO energy_daily (node_id, gpu_index, day, wh, meter_wh, updated_at)
SELECT node_id, gpu_index, %(day)s, delta, wh, %(now)s FROM growth
ON CONFLICT (node_id, gpu_index, day) DO UPDATE SET
    wh = energy_daily.wh + EXCLUDED.wh, meter_wh = EXCLUDED.meter_wh, updated_at = EXCLUDED.updated_at
"""


def roll_up_energy(now: datetime | None = None) -> dict:
    """Add each accumulator's growth since the previous rollup to today's (UTC)
    energy_daily row. Safe to run at any time and twice: a second run in a row finds
    nothing moved. The growth between the last rollup of a day and midnight lands on the
    next day (at most one period of the job)."""
    now = now or utcnow()
    day = now.astimezone(UTC).date()
    with connection.cursor() as cursor:
        cursor.execute(ROLLUP, {"day": day, "now": now})
        rows = cursor.rowcount
    return {"day": day.isoformat(), "rows": rows}
