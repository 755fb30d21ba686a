"""NVLink domains inside a node, from the `heteroflow.io/gpu-topology` label the agent
reports (JSON: {"nvlink": [[0, 1], [1, 2]], "numa": {"0": 0, "1": 0, "2": 1}}).

Cards joined by NVLink pairs form a domain (union-find); a card with no NVLink is a
domain of one (a PCIe card). A node without the label is neutral: score 50, never
filtered, cards picked by the plain rule.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

TOPOLOGY_LABEL = "heteroflow.io/gpu-topology"
NEUTRAL = 50.0


@dataclass(frozen=True)
class Topology:
    domain_of: dict[int, int]  # card index -> domain id (smallest index in it)
    numa_of: dict[int, int]

    def domain_size(self, domain: int) -> int:
        return sum(1 for d in self.domain_of.values() if d == domain)


def parse(labels: dict, card_indices) -> Topology | None:
    raw = (labels or {}).get(TOPOLOGY_LABEL)
    if not raw:
        return None
    try:
        data = json.loads(raw) if isinstance(raw, str) else raw
        pairs = [(int(a), int(b)) for a, b in data.get("nvlink", [])]
        numa = {int(card): int(node) for card, node in (data.get("numa") or {}).items()}
    except (ValueError, TypeError, AttributeError):
        return None  # unreadable data is no data
    parent = {index: index for index in card_indices}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        if a in parent and b in parent:
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    return Topology({index: find(index) for index in parent}, numa)


def choose(topology: Topology, free_cards: list[int], count: int) -> list[int]:
    """The smallest domain that fits (so big domains stay whole), same NUMA first inside
    it; if no domain fits, the largest domains first (the group must cross)."""
    by_domain = defaultdict(list)
    for card in sorted(free_cards):
        by_domain[topology.domain_of.get(card, card)].append(card)
    fitting = [cards for cards in by_domain.values() if len(cards) >= count]
    if fitting:
        cards = min(fitting, key=lambda c: (len(c), c[0]))
        by_numa = defaultdict(list)
        for card in cards:
            by_numa[topology.numa_of.get(card, -1)].append(card)
        ordered = [card for group in sorted(by_numa.values(), key=lambda g: (-len(g), g[0])) for card in group]
        return sorted(ordered[:count])
    chosen = []
    for cards in sorted(by_domain.values(), key=lambda c: (-len(c), c[0])):
        chosen.extend(cards[: count - len(chosen)])
        if len(chosen) == count:
            break
    return sorted(chosen)


def score(topology: Topology | None, free_cards: list[int], group: list[int]) -> float:
    """+50 one domain, +30 the task fills it exactly, +40 every card of it was free;
    −20 when forced across domains; +15 one NUMA node, −10 across."""
    if topology is None or not group:
        return NEUTRAL
    value = NEUTRAL
    domains = {topology.domain_of.get(card, card) for card in group}
    if len(domains) == 1:
        domain = domains.pop()
        value += 50
        size = topology.domain_size(domain)
        if size == len(group):
            value += 30
        members = [card for card, d in topology.domain_of.items() if d == domain]
        if all(card in free_cards for card in members):
            value += 40
    else:
        value -= 20
    numa = {topology.numa_of[card] for card in group if card in topology.numa_of}
    if numa:
        value += 15 if len(numa) == 1 else -10
    return value


def has_domain_for(topology: Topology | None, free_cards: list[int], count: int) -> bool:
    """`nvlink: required`: some single domain has `count` free cards. No data: pass."""
    if topology is None:
        return True
    by_domain = defaultdict(int)
    for card in free_cards:
        by_domain[topology.domain_of.get(card, card)] += 1
    return any(n >= count for n in by_domain.values())
