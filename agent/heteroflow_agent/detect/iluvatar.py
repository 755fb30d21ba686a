"""Iluvatar CoreX (天数智芯): ixsmi, which answers nvidia-smi's CSV query.

The spec classes Iluvatar as matched by position (no per-card failure attribution),
so only the parsing is shared with NVIDIA, not the UUID check.
"""

from __future__ import annotations

from .base import VendorTool
from .model import Card
from .nvidia import parse_query_csv

FIELDS = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
)


class IluvatarTool(VendorTool):
    vendor = "iluvatar"
    tools = ("ixsmi",)
    args = ("--query-gpu=" + ",".join(FIELDS), "--format=csv,noheader,nounits")

    def parse(self, text: str) -> list[Card]:
        return parse_query_csv(text, FIELDS)
