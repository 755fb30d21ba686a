"""Hygon DCU (海光): hy-smi's JSON report, one run per beat.

hy-smi sometimes prints banner lines around its JSON; the JSON is cut out of the text
before parsing. Cards are matched by position in the spec's matrix (no per-card
failure attribution): the "cardN" keys are re-numbered when a card drops off, so
`--showbus` is asked for too, and each card's PCI address ("PCI Bus") names it. Outside a
container, `hy-smi virtual -show-device-info` says which cards the vDCU tool (HAMi's
hygon-hami slices) can carve: `hami_capable` in the capabilities.
"""

from __future__ import annotations

import re

from .base import Runner, VendorTool
from .model import Card, Reading
from .rocm_json import parse_rocm_json

_BLOCK = re.compile(r"^\s*(Virtual Device|Device)\s+(\d+)\s*:")
_FIELD = re.compile(r"^\s*(Actual Device|Compute units|Global memory)\s*:\s*(\d+)")


def parse_devices(text: str) -> list[dict]:
    """Either listing: [{"id", "device", "compute_units", "memory_mib"}] ("id" is the
    block's number: the card for -show-device-info, the vDCU for -show-vdevice-info)."""
    rows: list[dict] = []
    current: dict | None = None
    for line in (text or "").splitlines():
        m = _BLOCK.match(line)
        if m:
            current = {"id": int(m[2])}
            rows.append(current)
            continue
        m = _FIELD.match(line) if current is not None else None
        if m:
            value = int(m[2])
            if m[1] == "Actual Device":
                current["device"] = value
            elif m[1] == "Compute units":
                current["compute_units"] = value
            else:
                current["memory_mib"] = value // 2**20
    return [r for r in rows if {"device", "compute_units", "memory_mib"} <= r.keys()]


class HygonTool(VendorTool):
    vendor = "hygon"
    tools = ("hy-smi",)
    args = (
        "--showproductname",
        "--showbus",
        "--showuse",
        "--showtemp",
        "--showpower",
        "--showmeminfo",
        "vram",
        "--json",
    )

    def parse(self, text: str) -> list[Card]:
        return parse_rocm_json(text)

    def read(self, path: str, run: Runner, *, slicing: bool = False) -> Reading:
        reading = super().read(path, run, slicing=slicing)
        if slicing and reading.cards:
            # HAMi's vDCU: the cards `hy-smi virtual -show-device-info` lists can be carved
            result = run([path, "virtual", "-show-device-info"])
            listed = {row["device"] for row in parse_devices(result.stdout)} if result.ok else set()
            reading.hami = {index: True for index in listed}
        return reading
