"""Enflame GCU (燧原): `efsmi -q`, one "DEV ID N" report per card.

Matched by position in the spec's matrix (no per-card failure attribution).
"""

from __future__ import annotations

import re

from .base import VendorTool
from .model import Card
from .parsing import lookup, number, sectioned_records, to_mib

_DEVICE = re.compile(r"^\s*DEV ID\s+(\d+)\s*$")


def _value(value):
    return None if value is None or value.strip().upper() in ("N/A", "NA", "-") else value


def parse_efsmi(text: str) -> list[Card]:
    cards: list[Card] = []
    for opened, record in sectioned_records(text, _DEVICE):
        index = int(opened.group(1))
        card = Card(key=str(index), index=index)
        card.model = _value(lookup(record, r"^device name$")) or ""
        card.uuid = _value(lookup(record, r"^device uuid$")) or ""
        card.temperature = number(_value(lookup(record, r"^temperature/gcu$", r"^temperature/[^/]+$")))
        card.power_w = number(_value(lookup(record, r"^power/(power )?(usage|draw)$")))
        card.memory_total_mb = to_mib(_value(lookup(record, r"^memory usage/total( size)?$")), "MiB")
        card.memory_used_mb = to_mib(_value(lookup(record, r"^memory usage/used( size)?$")), "MiB")
        card.utilization = number(_value(lookup(record, r"^gcu usage/(gcu )?usage$")))
        if card.read_anything():  # a "Card N" line and nothing usable after it is not a card
            cards.append(card)
    return cards


class EnflameTool(VendorTool):
    vendor = "enflame"
    tools = ("efsmi",)
    args = ("-q",)

    def parse(self, text: str) -> list[Card]:
        return parse_efsmi(text)
