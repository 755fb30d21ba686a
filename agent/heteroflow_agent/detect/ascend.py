"""Huawei Ascend (昇腾): the `npu-smi info` table.

Each chip takes two rows: "NPU Name | Health | Power Temp Hugepages" then
"Chip [Device] | Bus-Id | AICore Memory-Usage [HBM-Usage]". The accelerator's memory
is the HBM column when the card has HBM (910 family); the Memory-Usage column there is
the on-board control CPU's DDR, so it is used only on cards without HBM (310 family).
Power is printed but not read: the spec leaves Ascend power out for want of a trusted
sample, and the capability matrix drops it anyway.
"""

from __future__ import annotations

import re

from . import health as hl
from .base import Runner, VendorTool
from .model import Card
from .parsing import BUS_ID, number, pipe_cells, to_mib

_PAIR = re.compile(r"(\S+)\s*/\s*(\S+)")


def _pairs(text: str) -> list[tuple[int | None, int | None]]:
    return [(to_mib(a, "MiB"), to_mib(b, "MiB")) for a, b in _PAIR.findall(text)]


def parse_npu_smi(text: str) -> list[Card]:
    cards: list[Card] = []
    first = None  # the chip's first row, waiting for its second
    hbm = False  # the header has an HBM-Usage column: that is the NPU's memory
    for line in (text or "").splitlines():
        if "Process id" in line or "Process name" in line:
            break  # the process table below reuses the row shape
        if not line.lstrip().startswith("|"):
            continue
        cells = pipe_cells(line)
        if len(cells) != 3 or cells[0].startswith(("NPU", "Chip", "npu-smi")):
            hbm = hbm or (cells[0].startswith("Chip") and "HBM" in cells[-1])
            first = None
            continue
        head = cells[0].split()
        if first is None:
            if len(head) >= 2 and head[0].isdigit() and not BUS_ID.match(cells[1]):
                first = (int(head[0]), " ".join(head[1:]), cells[2])
            continue
        npu, name, readings = first
        first = None
        if not head or not head[0].isdigit():
            continue
        chip = int(head[0])
        device = int(head[1]) if len(head) > 1 and head[1].isdigit() else None
        card = Card(key=f"{npu}-{chip}", index=device if device is not None else npu, model=name)
        values = readings.split()
        card.temperature = number(values[1]) if len(values) > 1 else None
        usage = cells[2].split(None, 1)
        card.utilization = number(usage[0]) if usage else None
        pairs = _pairs(usage[1]) if len(usage) > 1 else []
        wanted = 1 if hbm else 0
        memory = pairs[wanted] if len(pairs) > wanted else (None, None)
        card.memory_used_mb, card.memory_total_mb = memory
        cards.append(card)
    if len({c.index for c in cards}) != len(cards):  # several chips per NPU, no Device column
        for position, card in enumerate(cards):
            card.index = position
    return cards


class AscendTool(VendorTool):
    vendor = "ascend"
    tools = ("npu-smi",)
    args = ("info",)

    def parse(self, text: str) -> list[Card]:
        return parse_npu_smi(text)

    def health(self, path: str, run: Runner, keys: list[str], root: str = "/") -> dict[str, dict] | None:
        """`npu-smi info -t ecc -i NPU -c CHIP` per chip (the card key is "npu-chip")."""
        out: dict[str, dict] = {}
        failures = []
        for key in keys:
            npu, _, chip = key.partition("-")
            if not (npu.isdigit() and chip.isdigit()):
                continue
            result = run([path, "info", "-t", "ecc", "-i", npu, "-c", chip])
            if result.timed_out:  # a hung tool is not asked about the next chip
                raise hl.HealthError(result.describe())
            reading = hl.parse_npu_ecc(result.stdout) if result.ok else None
            if reading is None:
                failures.append(result.describe())
                continue
            out[key] = reading
        if not out and failures:
            raise hl.HealthError(failures[0])
        return out
