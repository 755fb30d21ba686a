"""The two-row card table several vendors copied from nvidia-smi (MetaX mx-smi, Biren
brsmi):

    | 0     MetaX C500        | 0000:0f:00.0     | 0%          |
    | 36C   56W / 350W        | 858/65536 MiB    |             |

Row one: index and name, bus id, utilisation. Row two: temperature and power, memory.
The bus id is kept (`pci_bus_id`): these tools renumber their cards when one drops out,
and the bus id is what still names each card then.
"""

from __future__ import annotations

import re

from .model import Card
from .parsing import BUS_ID, number, pci_bus_id, pipe_cells, to_mib

_MEMORY = re.compile(r"^\s*(\S+?)(?:\s*MiB)?\s*/\s*(\S+?)\s*MiB\s*$", re.IGNORECASE)
_POWER = re.compile(r"(\S+?)\s*/\s*\S+W\b")  # "56W / 350W": usage before the slash, cap after
_TEMP = re.compile(r"^-?\d+(?:\.\d+)?C$")
_WATTS = re.compile(r"^\d+(?:\.\d+)?W$")


def _cells(line: str) -> list[str]:
    # "N/A" would read as a fraction in "N/A / 350W" and "N/A/65536 MiB"
    return [cell.replace("N/A", "NA") for cell in pipe_cells(line)]


def parse_two_row_table(text: str) -> list[Card]:
    cards: list[Card] = []
    lines = (text or "").splitlines()
    for number_, line in enumerate(lines):
        if not line.lstrip().startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) < 3:
            continue
        head = cells[0].split()
        bus = cells[1].split()
        if len(head) < 2 or not head[0].isdigit() or not bus or not BUS_ID.match(bus[0]):
            continue
        index = int(head[0])
        card = Card(key=str(index), index=index, model=" ".join(head[1:]), pci_bus_id=pci_bus_id(bus[0]))
        util = cells[2].split()
        card.utilization = number(util[0]) if util and util[0].endswith("%") else None
        if number_ + 1 < len(lines) and lines[number_ + 1].lstrip().startswith("|"):
            second = _cells(lines[number_ + 1])
            tokens = second[0].split() if second else []
            card.temperature = next((number(t) for t in tokens if _TEMP.match(t)), None)
            power = _POWER.search(second[0]) if second else None
            card.power_w = number(power.group(1)) if power and _WATTS.match(power.group(1)) else None
            memory = _MEMORY.match(second[1]) if len(second) > 1 else None
            if memory:
                card.memory_used_mb = to_mib(memory.group(1), "MiB")
                card.memory_total_mb = to_mib(memory.group(2), "MiB")
        cards.append(card)
    return cards
