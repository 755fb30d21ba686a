"""Biren (壁仞): the brsmi card table, matched by position in the spec's matrix.

The model name brsmi prints is known to be unreliable; the spec has the server correct
it from the memory size (32512 MB is a 106M, 65536 MB a BR100), so the name is passed
on as printed and the memory total is what matters.
"""

from __future__ import annotations

from .base import VendorTool
from .model import Card
from .smi_table import parse_two_row_table


class BirenTool(VendorTool):
    vendor = "biren"
    tools = ("brsmi", "birensmi")

    def parse(self, text: str) -> list[Card]:
        return parse_two_row_table(text)
