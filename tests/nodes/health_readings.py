"""Card health readings as the agent sends them in a beat's `gpu_health` (the contract in
the shared design: a field the tool cannot read is absent and not in `available`), for
the tests of the judgement, the API and the page. The values are those of the ECC,
retired-pages and Xid sections of `nvidia-smi -q` in NVIDIA's documentation."""

from __future__ import annotations

from apps.nodes.health import COUNTERS, FLAGS
from apps.nodes.models import GpuHealthSample

# everything nvidia-smi reports, in the order the agent writes `available`
NVIDIA_AVAILABLE = ["ecc_mode", *COUNTERS, *FLAGS, "xid_events", "throttle_reasons"]


def nvidia_reading(index: int, **changes) -> dict:
    """A healthy H100's reading (nothing wrong), with `changes`."""
    reading = {
        "index": index,
        "available": list(NVIDIA_AVAILABLE),
        "ecc_mode": "enabled",
        "ecc_corrected_volatile": 0,
        "ecc_uncorrected_volatile": 0,
        "ecc_corrected_aggregate": 0,
        "ecc_uncorrected_aggregate": 0,
        "retired_pages_single_bit": 0,
        "retired_pages_double_bit": 0,
        "retired_pages_pending": False,
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": False,
        "remapped_rows_failure": False,
        "xid_events": [],
        "throttle_reasons": [],
    }
    reading.update(changes)
    return reading


def partial_reading(index: int, fields: dict) -> dict:
    """A vendor whose tool reads only `fields` (the rest absent, not 0)."""
    return {"index": index, "available": sorted(fields), **fields}


def xid(code: int, at: str, text: str = "") -> dict:
    return {"code": code, "at": at, "text": text}


def make_health_sample(node_id: str, index: int, at, *, model: str = "H100", vendor: str = "nvidia", **fields):
    """A row of a card's health history as the heartbeat's step writes it (past the step,
    so a test can build any history): `fields` are the sample's columns."""
    return GpuHealthSample.objects.create(
        node_id=node_id, gpu_index=index, model=model, vendor=vendor, at=at, **{"available": [], **fields}
    )
