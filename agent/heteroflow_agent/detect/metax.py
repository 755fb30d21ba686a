"""MetaX (沐曦): the mx-smi card table, matched by position in the spec's matrix."""

from __future__ import annotations

from .base import VendorTool
from .model import Card
from .smi_table import parse_two_row_table


class MetaxTool(VendorTool):
    vendor = "metax"
    tools = ("mx-smi",)

    def parse(self, text: str) -> list[Card]:
        return parse_two_row_table(text)
