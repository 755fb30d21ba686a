"""Kunlunxin XPU (昆仑芯): the xpu_smi / xpu-smi device table, read by its header.

Columns are found by name (DevID, Model, UseRate, Memory, Power(W), Temp) rather than
by position, since the set of columns differs between releases. Intel ships an
unrelated tool also called xpu-smi, so that name alone does not make a Kunlun node:
it counts only with Kunlun device nodes (/dev/xpu*) present. The table names each
card, so the spec's matrix gives Kunlun partial attribution.
"""

from __future__ import annotations

import glob
import os
import re

from .base import VendorTool
from .command import find_command
from .model import Card
from .parsing import number, pipe_cells, to_mib

_MEMORY = re.compile(r"^\s*(\S+)\s*/\s*(\S+)\s*([KMG]i?B)?\s*$", re.IGNORECASE)


def parse_xpu_smi(text: str) -> list[Card]:
    cards: list[Card] = []
    header = None
    for line in (text or "").splitlines():
        if header is None:
            if "DevID" in line and line.lstrip().startswith("|"):
                header = [c.lower() for c in pipe_cells(line)]
            continue
        if "DevID" in line or "process" in line.lower():
            break  # the process table follows and reuses DevID
        if not line.lstrip().startswith("|"):
            continue
        cells = pipe_cells(line)
        if len(cells) != len(header):
            continue
        row = dict(zip(header, cells))
        dev = row.get("devid", "")
        if not dev.isdigit():
            continue
        card = Card(key=dev, index=int(dev), model=row.get("model", ""))
        card.utilization = number(row.get("userate"))
        memory = _MEMORY.match(row.get("memory", ""))
        if memory:
            unit = memory.group(3) or "MiB"
            card.memory_used_mb = to_mib(number(memory.group(1)), unit)
            card.memory_total_mb = to_mib(number(memory.group(2)), unit)
        card.power_w = number(row.get("power(w)", row.get("power")))
        card.temperature = number(row.get("temp", row.get("temp(c)")))
        cards.append(card)
    return cards


class KunlunTool(VendorTool):
    vendor = "kunlun"
    tools = ("xpu_smi", "xpu-smi")

    def locate(self, root: str) -> str | None:
        path = find_command("xpu_smi", root)
        if path:
            return path
        path = find_command("xpu-smi", root)
        if path and glob.glob(os.path.join(root, "dev", "xpu[0-9]*")):
            return path
        return None

    def parse(self, text: str) -> list[Card]:
        return parse_xpu_smi(text)
