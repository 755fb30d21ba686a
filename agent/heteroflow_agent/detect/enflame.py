"""Enflame GCU (燧原): `efsmi -q`, one "DEV ID N" report per card.

Two layouts are read. The one efsmi prints on current drivers groups its fields in
sections ("Device Info" / "Dev Name", "Dev UUID"; "PCIe Info" / "Domain", "Bus", "Dev",
"Func"; "Power Info" / "Cur Power"; "Device Mem Info" / "Total Size", "Used Size" (older:
"Mem Size", "Mem Usage"); "Temperature Info" / "GCU Temp"; "Device Usage Info" / "GCU
Usage"). The other names them "Device Name", "Device UUID", "Bus Id", "Temperature" /
"GCU", "Power" / "Usage", "Memory Usage" / "Total", "Used", "GCU Usage" / "Usage".

Matched by position in the spec's matrix (no per-card failure attribution): efsmi
renumbers its cards when one drops out, so each card's UUID and PCI address are kept to
name it.
"""

from __future__ import annotations

import re

from .base import VendorTool
from .model import Card
from .parsing import lookup, number, pci_bus_id, sectioned_records, to_mib

_DEVICE = re.compile(r"^\s*DEV ID\s+(\d+)\s*$")


def _value(value):
    return None if value is None or value.strip().upper() in ("N/A", "NA", "-") else value


def _field(record: dict, *patterns: str):
    return _value(lookup(record, *patterns))


def _bus(record: dict) -> str:
    """The card's PCI address: one "Bus Id" line, or the PCIe section's four fields."""
    whole = _field(record, r"^bus id$", r"(^|/)bus-id$")
    if whole:
        return pci_bus_id(whole)
    parts = [_field(record, rf"^pcie info/{name}$") for name in ("domain", "bus", "dev", "func")]
    if None in parts:
        return ""
    domain, bus, dev, func = (part.strip() for part in parts)
    if not all(re.fullmatch(r"[0-9A-Fa-f]+", part) for part in (domain, bus, dev, func)):
        return ""
    return pci_bus_id(f"{domain}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(func, 16)}")


def parse_efsmi(text: str) -> list[Card]:
    cards: list[Card] = []
    for opened, record in sectioned_records(text, _DEVICE):
        index = int(opened.group(1))
        card = Card(key=str(index), index=index)
        card.model = _field(record, r"^device name$", r"^device info/dev name$") or ""
        card.uuid = _field(record, r"^device uuid$", r"^device info/dev uuid$") or ""
        card.pci_bus_id = _bus(record)
        card.temperature = number(
            _field(record, r"^temperature/gcu$", r"^temperature info/gcu temp$", r"^temperature/[^/]+$")
        )
        card.power_w = number(_field(record, r"^power/(power )?(usage|draw)$", r"^power info/cur power$"))
        card.memory_total_mb = to_mib(
            _field(record, r"^memory usage/total( size)?$", r"^device mem info/(total size|mem size)$"), "MiB"
        )
        card.memory_used_mb = to_mib(
            _field(record, r"^memory usage/used( size)?$", r"^device mem info/(used size|mem usage)$"), "MiB"
        )
        card.utilization = number(_field(record, r"^gcu usage/(gcu )?usage$", r"^device usage info/gcu usage$"))
        if card.read_anything():  # a "Card N" line and nothing usable after it is not a card
            cards.append(card)
    return cards


class EnflameTool(VendorTool):
    vendor = "enflame"
    tools = ("efsmi",)
    args = ("-q",)

    def parse(self, text: str) -> list[Card]:
        return parse_efsmi(text)
