"""AMD Instinct / Radeon: amd-smi, falling back to rocm-smi on older ROCm.

Not one of the spec's ten detectors; it runs after them, so a Hygon node (whose DTK
also ships a rocm-smi) is claimed by hy-smi first. amd-smi's `metric` report is read
every beat and its `static` report once, for the card names. Both tools name each
card by index, hence partial attribution.
"""

from __future__ import annotations

import os

from . import health as hl
from .base import Runner, VendorTool, reading_from
from .model import Card, Reading
from .parsing import extract_json, number, to_mib
from .rocm_json import parse_rocm_json

AMD_SMI_METRIC = ("metric", "--usage", "--power", "--temperature", "--mem-usage", "--json")
AMD_SMI_STATIC = ("static", "--asic", "--json")
ROCM_SMI = (
    "--showproductname",
    "--showuniqueid",
    "--showuse",
    "--showtemp",
    "--showpower",
    "--showmeminfo",
    "vram",
    "--json",
)


def _entries(data) -> list:
    if isinstance(data, dict) and isinstance(data.get("gpu_data"), list):
        data = data["gpu_data"]  # amd-smi 6.4 and later wrap the list
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []


def _value(item) -> float | None:
    """amd-smi writes {"value": 41, "unit": "C"} or, in older releases, "41 C" or 41."""
    if isinstance(item, dict):
        item = item.get("value")
    return number(item)


def _first(section, *keys) -> float | None:
    if not isinstance(section, dict):
        return None
    for key in keys:
        value = _value(section.get(key))
        if value is not None:
            return value
    return None


def _mib(item) -> int | None:
    if isinstance(item, dict):
        return to_mib(number(item.get("value")), str(item.get("unit") or "MB"))
    return to_mib(item, "MB") if item is not None else None


def parse_amd_smi_metric(text: str, names: dict[int, str] | None = None) -> list[Card]:
    cards: list[Card] = []
    for entry in _entries(extract_json(text)):
        index = entry.get("gpu")
        if not isinstance(index, int) or isinstance(index, bool):
            continue
        card = Card(key=str(index), index=index, model=(names or {}).get(index, ""))
        card.utilization = _first(entry.get("usage"), "gfx_activity", "gfx_usage")
        card.power_w = _first(entry.get("power"), "socket_power", "average_socket_power", "current_socket_power")
        card.temperature = _first(entry.get("temperature"), "edge", "hotspot", "junction", "mem")
        memory = entry.get("mem_usage")
        if isinstance(memory, dict):
            card.memory_total_mb = _mib(memory.get("total_vram"))
            card.memory_used_mb = _mib(memory.get("used_vram"))
        cards.append(card)
    return cards


def parse_amd_smi_static(text: str) -> dict[int, str]:
    names: dict[int, str] = {}
    for entry in _entries(extract_json(text)):
        index, asic = entry.get("gpu"), entry.get("asic")
        if isinstance(index, int) and isinstance(asic, dict):
            name = str(asic.get("market_name") or "").strip()
            if name and name.upper() != "N/A":
                names[index] = name
    return names


class AmdTool(VendorTool):
    vendor = "amd"
    tools = ("amd-smi", "rocm-smi")

    def __init__(self):
        self._names: dict[int, str] | None = None

    def read(self, path: str, run: Runner, *, slicing: bool = False) -> Reading:
        if os.path.basename(path) == "rocm-smi":
            return reading_from(run([path, *ROCM_SMI]), parse_rocm_json)
        if self._names is None:  # names do not change; one run, the first time it works
            static = run([path, *AMD_SMI_STATIC])
            if static.ok:
                self._names = parse_amd_smi_static(static.stdout)
        return reading_from(run([path, *AMD_SMI_METRIC]), lambda text: parse_amd_smi_metric(text, self._names))

    def health(self, path: str, run: Runner, keys: list[str], root: str = "/") -> dict[str, dict] | None:
        """amd-smi's ECC totals. rocm-smi has no documented machine-readable RAS report
        (`--showrasinfo --json` prints "No JSON data to report", ROCm issue #4374), so a
        node on rocm-smi alone reports no health."""
        if os.path.basename(path) != "amd-smi":
            return None
        result = run([path, *hl.AMD_SMI_ECC])
        cards = hl.parse_amd_ecc(result.stdout) if not (result.timed_out or result.error) else {}
        if not cards and not result.ok:
            raise hl.HealthError(result.describe())
        return {str(index): reading for index, reading in cards.items()}
