"""MIG instance listings from nvidia-smi, parsed (formats of the NVIDIA Multi-Instance
GPU User Guide): the GPU instances (`nvidia-smi mig -lgi`), compute instances (`-lci`),
GPU instance profiles (`-lgip`), the "MIG devices:" section of the plain `nvidia-smi`
table and `nvidia-smi -L`. Joined, they give each card's instances with their MIG
UUIDs: the heartbeat reports them (mig_instances) and the slice vendor
(heteroflow_agent.slicing.mig) diffs them around each create and destroy.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .command import ToolResult

_LGIP = re.compile(r"^\|\s*(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)/(\d+)\s+([\d.]+)\s")
_LGI = re.compile(r"^\|\s*(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+):(\d+)\s*\|")
_LCI = re.compile(r"^\|\s*(\d+)\s+(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+):(\d+)\s*\|")
_GPU_LINE = re.compile(r"^GPU\s+(\d+):.*\(UUID:\s*(GPU-[^)\s]+)\)")
_MIG_LINE = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+(\d+):\s*\(UUID:\s*(MIG-[^)\s]+)\)")
_MIG_ROW = re.compile(r"^\|\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*\|")
NOTHING = ("No GPU instances found", "No compute instances found")


def parse_profiles(text: str) -> list[dict]:
    """`nvidia-smi mig -lgip`: [{"gpu", "name", "id", "free", "total", "memory_gib"}]."""
    rows = []
    for line in (text or "").splitlines():
        m = _LGIP.match(line)
        if m:
            rows.append(
                {
                    "gpu": int(m[1]),
                    "name": m[2],
                    "id": int(m[3]),
                    "free": int(m[4]),
                    "total": int(m[5]),
                    "memory_gib": float(m[6]),
                }
            )
    return rows


def parse_gpu_instances(text: str) -> list[dict]:
    """`nvidia-smi mig -lgi`: [{"gpu", "profile", "profile_id", "gi", "start", "size"}]."""
    rows = []
    for line in (text or "").splitlines():
        m = _LGI.match(line)
        if m:
            rows.append(
                {"gpu": int(m[1]), "profile": m[2], "profile_id": int(m[3]), "gi": int(m[4]), "start": int(m[5])}
            )
    return rows


def parse_compute_instances(text: str) -> list[dict]:
    """`nvidia-smi mig -lci`: [{"gpu", "gi", "profile", "ci"}]."""
    rows = []
    for line in (text or "").splitlines():
        m = _LCI.match(line)
        if m:
            rows.append({"gpu": int(m[1]), "gi": int(m[2]), "profile": m[3], "ci": int(m[5])})
    return rows


def parse_listing(text: str) -> dict[int, dict]:
    """`nvidia-smi -L`: {gpu index: {"uuid": "GPU-…", "devices": {MIG device index: uuid}}}."""
    cards: dict[int, dict] = {}
    current = None
    for line in (text or "").splitlines():
        m = _GPU_LINE.match(line)
        if m:
            current = cards[int(m[1])] = {"uuid": m[2], "devices": {}}
            continue
        m = _MIG_LINE.match(line)
        if m and current is not None:
            current["devices"][int(m[2])] = m[3]
    return cards


def parse_mig_devices(text: str) -> dict[tuple[int, int], int]:
    """The "MIG devices:" section of the plain `nvidia-smi` table: {(gpu, MIG device
    index): (gi, ci)}."""
    devices: dict = {}
    inside = False
    for line in (text or "").splitlines():
        if "MIG devices:" in line:
            inside = True
            continue
        if inside and line.startswith("| Processes"):
            break
        m = _MIG_ROW.match(line) if inside else None
        if m:
            devices[(int(m[1]), int(m[4]))] = (int(m[2]), int(m[3]))
    return devices


def _empty_listing(result: ToolResult) -> bool:
    return any(word in result.stdout + result.stderr for word in NOTHING)


class ListingError(Exception):
    pass


def list_instances(run: Callable, path: str) -> dict[int, list[dict]]:
    """Every MIG instance per card index: [{"uuid", "gi", "ci", "profile"}], a GPU
    instance without a compute instance as {"uuid": "", "gi", "profile"} (no "ci"). Raises
    ListingError when a listing failed (not: found nothing)."""
    results = {}
    for key, argv in (
        ("lgi", [path, "mig", "-lgi"]),
        ("lci", [path, "mig", "-lci"]),
        ("table", [path]),
        ("list", [path, "-L"]),
    ):
        result = run(argv)
        if not result.ok and not (key in ("lgi", "lci") and _empty_listing(result)):
            raise ListingError(result.describe())
        results[key] = result.stdout
    gis = parse_gpu_instances(results["lgi"])
    cis = parse_compute_instances(results["lci"])
    devices = parse_mig_devices(results["table"])
    listing = parse_listing(results["list"])
    by_handles = {}
    for (gpu, device), (gi, ci) in devices.items():
        uuid = listing.get(gpu, {}).get("devices", {}).get(device)
        if uuid:
            by_handles[(gpu, gi, ci)] = uuid
    cards: dict[int, list[dict]] = {}
    for gi in gis:
        mine = [ci for ci in cis if ci["gpu"] == gi["gpu"] and ci["gi"] == gi["gi"]]
        entries = cards.setdefault(gi["gpu"], [])
        for ci in mine:
            uuid = by_handles.get((gi["gpu"], gi["gi"], ci["ci"]), "")
            entries.append({"uuid": uuid, "gi": gi["gi"], "ci": ci["ci"], "profile": gi["profile"]})
        if not mine:
            entries.append({"uuid": "", "gi": gi["gi"], "profile": gi["profile"]})
    for entries in cards.values():
        entries.sort(key=lambda e: (e["gi"], e.get("ci", -1)))
    return cards
