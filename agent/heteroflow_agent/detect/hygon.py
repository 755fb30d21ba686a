"""Hygon DCU (海光): hy-smi's JSON report, one run per beat.

hy-smi sometimes prints banner lines around its JSON; the JSON is cut out of the text
before parsing. Cards are matched by position in the spec's matrix (no per-card
failure attribution): the "cardN" keys are re-numbered when a card drops off.
"""

from __future__ import annotations

from .base import VendorTool
from .model import Card
from .rocm_json import parse_rocm_json


class HygonTool(VendorTool):
    vendor = "hygon"
    tools = ("hy-smi",)
    args = ("--showproductname", "--showuse", "--showtemp", "--showpower", "--showmeminfo", "vram", "--json")

    def parse(self, text: str) -> list[Card]:
        return parse_rocm_json(text)
