"""Which of a node's GPU rows each card of a heartbeat is: the one rule, pure.

A node's cards are rows keyed by (node, index), and a row's index is the card's name for
the lost-card judgement, its alert, its health and the GPU ledger. Some vendors' tools
number the cards by position and renumber them when one drops out (Hygon, Iluvatar,
Biren, Moore Threads, MetaX, Enflame; the agent says so with `gpu_index_basis:
"position"`): card 1 of 4 fails, and the tool lists the old cards 2 and 3 as 1 and 2.
Matched by index, the server would take card 2 for card 1 and call card 3 lost.

So each reported card is matched to a row by what does not move, where both the beat and
the row carry it: its UUID, else its PCI address (not when both carry a UUID that
differs: another card in the same slot). A card with neither takes the row at its index,
unless that row's card is reported elsewhere; so a card replaced in its slot takes the
slot's row, as a beat without identities always did. A card still unmatched gets a new
row, at its own index when that is free. Rows no card claims are the cards that went
missing: the ones named lost.

The row keeps its index; the index the agent reports the card under now is kept beside
it (`reported_index`), and the beat reads the card's readings by that. A card known only
by its position (`CardIdentity.POSITION`: no UUID, no address, indices that are
positions) cannot be told from its neighbours: when one goes missing, the row at the
position that went missing is judged lost, and the judgement says that which card it was
cannot be told (apps.nodes.heartbeat).

An agent's collect failures (a card it knows but could not read, apps.nodes.heartbeat)
are matched like cards, so that they land on their card's row; they never create a row.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from apps.nodes.choices import CardIdentity

POSITION_BASIS = "position"  # the heartbeat's gpu_index_basis for positional indices


@dataclass(frozen=True)
class Row:
    """A card as the node's rows know it."""

    index: int
    uuid: str = ""
    pci_bus_id: str = ""


@dataclass(frozen=True)
class Reported:
    """A card as a beat reports it: a gpu_stat, or only a collect failure (`stat` False)."""

    index: int  # the agent's
    uuid: str = ""
    pci_bus_id: str = ""
    stat: bool = True


@dataclass(frozen=True)
class Placement:
    rows: dict[int, int]  # the agent's index -> the row's index, for each reported card placed
    created: frozenset[int]  # the rows' indices that are new
    unreported: tuple[int, ...]  # the existing rows no reported card claimed, by index


def _unique(values) -> set[str]:
    counts = Counter(value for value in values if value)
    return {value for value, count in counts.items() if count == 1}


def place(rows: list[Row], reported: list[Reported]) -> Placement:
    """Each reported card's row (see the module's docstring). Deterministic: cards are
    taken in the agent's index order, a new row gets the lowest free index."""
    by_index = {row.index: row for row in rows}
    row_uuids, row_buses = _unique(r.uuid for r in rows), _unique(r.pci_bus_id for r in rows)
    beat_uuids, beat_buses = _unique(r.uuid for r in reported), _unique(r.pci_bus_id for r in reported)
    by_uuid = {row.uuid: row.index for row in rows if row.uuid in row_uuids}
    by_bus = {row.pci_bus_id: row.index for row in rows if row.pci_bus_id in row_buses}
    cards = sorted(reported, key=lambda r: (r.index, not r.stat))
    placed: dict[int, int] = {}
    claimed: set[int] = set()

    def claim(card: Reported, index: int | None) -> None:
        if index is not None and index not in claimed and card.index not in placed:
            placed[card.index] = index
            claimed.add(index)

    for card in cards:  # 1: the UUID, where both carry one
        if card.uuid in beat_uuids:
            claim(card, by_uuid.get(card.uuid))
    for card in cards:  # 2: the PCI address, unless both carry a UUID (that differs)
        index = by_bus.get(card.pci_bus_id) if card.pci_bus_id in beat_buses else None
        if index is not None and not (card.uuid and by_index[index].uuid):
            claim(card, index)
    for card in cards:  # 3: the index, for a card nothing else placed
        if card.index in by_index:
            claim(card, card.index)
    taken = set(by_index)
    created = set()
    for card in cards:  # 4: a new row
        if card.index in placed or not card.stat:
            continue
        index = card.index if card.index not in taken else min(set(range(len(taken) + 1)) - taken)
        taken.add(index)
        created.add(index)
        placed[card.index] = index
    return Placement(
        rows=placed,
        created=frozenset(created),
        unreported=tuple(sorted(index for index in by_index if index not in claimed)),
    )


def identity_kind(stat: dict, basis: str | None, *, uuids: set[str], buses: set[str]) -> str:
    """How a reported card is told apart from now on (CardIdentity): `uuids` and `buses`
    are the values unique in its beat (one shown by two cards tells nothing)."""
    if stat.get("uuid") in uuids:
        return CardIdentity.UUID
    if stat.get("pci_bus_id") in buses:
        return CardIdentity.PCI_BUS_ID
    return CardIdentity.POSITION if basis == POSITION_BASIS else CardIdentity.INDEX


def reported_cards(payload: dict) -> list[Reported]:
    """The beat's cards: its gpu_stats, and its collect failures not among them."""
    stats = [
        Reported(stat["index"], stat.get("uuid", ""), stat.get("pci_bus_id", ""))
        for stat in payload.get("gpu_stats", ())
    ]
    listed = {card.index for card in stats}
    failures = [
        Reported(failure["index"], failure.get("uuid", ""), stat=False)
        for failure in payload.get("gpu_collect_failures", ())
        if failure["index"] not in listed
    ]
    return stats + failures


def unique_identities(payload: dict) -> tuple[set[str], set[str]]:
    """The UUIDs and the PCI addresses that exactly one of the beat's cards shows."""
    stats = payload.get("gpu_stats", ())
    return _unique(s.get("uuid", "") for s in stats), _unique(s.get("pci_bus_id", "") for s in stats)
