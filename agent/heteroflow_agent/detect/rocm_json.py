"""The `--json` report of rocm-smi and of Hygon's hy-smi (a rocm-smi derivative).

Keys are matched loosely because the two tools and their versions name the same value
differently: "GPU use (%)" / "DCU use (%)" / "HCU use (%)", "VRAM Total Memory (B)" /
"vram Total Memory (MiB)". `--showbus` adds "PCI Bus": the address alone on rocm-smi and
older hy-smi, "0000:05:00.0 --> SN: ... --> OAM ID: 1" on hy-smi for HCU cards.
"""

from __future__ import annotations

import re

from .model import Card
from .parsing import extract_json, number, pci_bus_id, to_mib

_MISSING = {"", "N/A", "NA", "-", "UNKNOWN", "NONE"}


def _find(info: dict, *patterns: str) -> tuple[str | None, re.Match | None]:
    for pattern in patterns:
        regex = re.compile(pattern, re.IGNORECASE)
        for key, value in info.items():
            match = regex.search(key)
            if match and str(value).strip().upper() not in _MISSING:
                return str(value).strip(), match
    return None, None


def _memory(info: dict, pattern: str) -> int | None:
    value, match = _find(info, pattern)
    if value is None:
        return None
    return to_mib(number(value), match.group("unit"))


def parse_rocm_json(text: str) -> list[Card]:
    data = extract_json(text)
    if not isinstance(data, dict):
        return []
    cards: list[Card] = []
    for key, info in data.items():
        match = re.fullmatch(r"card(\d+)", str(key))
        if not match or not isinstance(info, dict):
            continue
        index = int(match.group(1))
        card = Card(key=str(index), index=index)
        card.model = _find(info, r"^card series$", r"^device name$", r"^card model$")[0] or ""
        card.uuid = _find(info, r"^unique id$")[0] or ""
        card.pci_bus_id = pci_bus_id(_find(info, r"^pci bus$")[0])
        card.utilization = number(_find(info, r"^(gpu|dcu|hcu) use \(%\)$")[0])
        card.temperature = number(
            _find(
                info,
                r"^temperature \(sensor edge\) \(c\)$",
                r"^temperature \(sensor junction\) \(c\)$",
                r"^temperature \(sensor core\) \(c\)$",
                r"^temperature \(sensor mem(ory)?\) \(c\)$",
            )[0]
        )
        card.power_w = number(_find(info, r"^(average|current).*power \(w\)$", r"^(?!max).*package power \(w\)$")[0])
        card.memory_total_mb = _memory(info, r"^vram total memory \((?P<unit>[kmg]?i?b)\)$")
        card.memory_used_mb = _memory(info, r"^vram total used memory \((?P<unit>[kmg]?i?b)\)$")
        cards.append(card)
    return cards
