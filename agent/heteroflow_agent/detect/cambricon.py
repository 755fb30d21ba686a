"""Cambricon MLU (寒武纪): `cnmon info`, one "Card N" report per card.

The report names every card, so a card missing while others answer can be reported
against it (partial attribution in the spec's matrix).
"""

from __future__ import annotations

import re

from .base import VendorTool
from .model import Card
from .parsing import lookup, number, sectioned_records, to_mib

_CARD = re.compile(r"^\s*Card\s+(\d+)\s*$")


def _value(value):
    return None if value is None or value.strip().upper() in ("N/A", "NA", "-") else value


def parse_cnmon_info(text: str) -> list[Card]:
    cards: list[Card] = []
    for opened, record in sectioned_records(text, _CARD):
        index = int(opened.group(1))
        card = Card(key=str(index), index=index)
        card.model = _value(lookup(record, r"^product name$")) or ""
        card.uuid = _value(lookup(record, r"^uuid$")) or ""
        card.utilization = number(_value(lookup(record, r"^utilization/mlu average$")))
        card.temperature = number(_value(lookup(record, r"^temperature/chip$", r"^temperature/board$")))
        card.power_w = number(_value(lookup(record, r"^power(?: info)?/usage$")))
        card.memory_total_mb = to_mib(_value(lookup(record, r"^physical memory usage/total$")), "MiB")
        card.memory_used_mb = to_mib(_value(lookup(record, r"^physical memory usage/used$")), "MiB")
        if card.read_anything():  # a "Card N" line and nothing usable after it is not a card
            cards.append(card)
    return cards


class CambriconTool(VendorTool):
    vendor = "cambricon"
    tools = ("cnmon",)
    args = ("info",)

    def parse(self, text: str) -> list[Card]:
        return parse_cnmon_info(text)
