"""Moore Threads MUSA (摩尔线程): the mthreads-gmi card table.

    0    MTT S4000      |00000000:3f:00.0    |0%    1214MiB(49152MiB)
         Physical       |16x(16x)            |42C   YES

The row gives index, name, bus id, utilisation and memory used(total); the line below
it gives the temperature. Matched by position in the spec's matrix: the tool renumbers
its cards when one drops out, so the bus id is kept (`pci_bus_id`) to name each card.
"""

from __future__ import annotations

import re

from .base import VendorTool
from .model import Card
from .parsing import BUS_ID, number, pci_bus_id, to_mib

_ROW = re.compile(r"^\s*(\d+)\s+(\S.*?)\s*\|\s*(\S+)\s*\|\s*(\S+)\s+(\S+)\s*$")
_MEMORY = re.compile(r"^(\S+?)\((\S+?)\)$")


def parse_mthreads_gmi(text: str) -> list[Card]:
    cards: list[Card] = []
    lines = (text or "").splitlines()
    for position, line in enumerate(lines):
        row = _ROW.match(line)
        if not row or not BUS_ID.match(row.group(3)):
            continue
        index = int(row.group(1))
        card = Card(key=str(index), index=index, model=row.group(2), pci_bus_id=pci_bus_id(row.group(3)))
        card.utilization = number(row.group(4)) if row.group(4).endswith("%") else None
        memory = _MEMORY.match(row.group(5))
        if memory:
            card.memory_used_mb = to_mib(memory.group(1), "MiB")
            card.memory_total_mb = to_mib(memory.group(2), "MiB")
        if position + 1 < len(lines):
            below = lines[position + 1].split("|")
            if len(below) >= 3:
                temp = below[2].split()
                if temp and re.fullmatch(r"-?\d+(?:\.\d+)?C", temp[0]):
                    card.temperature = number(temp[0])
        cards.append(card)
    return cards


class MusaTool(VendorTool):
    vendor = "musa"
    tools = ("mthreads-gmi",)

    def parse(self, text: str) -> list[Card]:
        return parse_mthreads_gmi(text)
