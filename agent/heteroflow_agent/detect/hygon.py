"""Hygon DCU (海光): hy-smi's JSON report, one run per beat.

hy-smi sometimes prints banner lines around its JSON; the JSON is cut out of the text
before parsing. Cards are matched by position in the spec's matrix (no per-card
failure attribution): the "cardN" keys are re-numbered when a card drops off. Outside a
container, `hy-smi virtual -show-device-info` says which cards the vDCU tool (HAMi's
hygon-hami slices) can carve: `hami_capable` in the capabilities.
"""

from __future__ import annotations

from heteroflow_agent.slicing.hami import parse_devices

from .base import Runner, VendorTool
from .model import Card, Reading
from .rocm_json import parse_rocm_json


class HygonTool(VendorTool):
    vendor = "hygon"
    tools = ("hy-smi",)
    args = ("--showproductname", "--showuse", "--showtemp", "--showpower", "--showmeminfo", "vram", "--json")

    def parse(self, text: str) -> list[Card]:
        return parse_rocm_json(text)

    def read(self, path: str, run: Runner, *, slicing: bool = False) -> Reading:
        reading = super().read(path, run, slicing=slicing)
        if slicing and reading.cards:
            # HAMi's vDCU: the cards `hy-smi virtual -show-device-info` lists can be carved
            result = run([path, "virtual", "-show-device-info"])
            listed = {row["device"] for row in parse_devices(result.stdout)} if result.ok else set()
            reading.hami = {index: True for index in listed}
        return reading
