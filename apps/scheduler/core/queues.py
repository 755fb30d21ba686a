"""Queues: how the fleet is shared between tenants (docs/queues.md). Pure, like the rest
of the core: the cycle gives it each tenant's queue, the cards each one holds now and its
decayed usage; it answers whether a placement is admitted, in which order the tenants
that must borrow come, and which borrowed work a reclaim stops.

The model:

- A tenant's **queue** gives it, per GPU type (vendor), a `nominal` number of cards
  (guaranteed), a `borrowing_limit` (how far above nominal it may go on others' idle
  cards; None: no limit) and a `lending_limit` (how much of its idle nominal others may
  use; None: all of it), and a `weight` for its fair share. A type it names no quota for
  has nominal 0.
- Tenants in the same **cohort** lend to and borrow from each other; a tenant with no
  cohort neither lends nor borrows (it runs within its nominal). A tenant with no queue
  at all is not limited here (as before queues existed).
- **Usage** is counted in cards, a shared card as its share (memory / the card's total),
  whatever holds it: tasks, group members, inference replicas.
- A placement that keeps its tenant within nominal is admitted. One that takes it above
  nominal borrows: admitted while the tenant stays within its borrowing limit and the
  cohort's lendable cards (each other member's idle nominal, up to its lending limit)
  cover everything the cohort's members borrow, this included.
- Between tenants that must borrow, the lowest **dominant share** goes first: usage
  above nominal, decayed with a half-life, divided by weight (`dominant_share`).
- A placement within nominal that finds no room stops the cohort's borrowing of that type
  for the rest of the cycle (`found_no_room`): the cards that come free are its.
- **Reclaim**: a tenant whose placement is within its nominal, refused for room, may stop
  work its cohort's members run above their nominal; only that work (a borrower's newest
  work beyond its nominal), lowest priority first, then newest first (`reclaim_order`).

Cards are floats throughout: a share of a card is a fraction of one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

EPSILON = 1e-9  # card counts are sums of fractions


@dataclass(frozen=True, slots=True)
class Quota:
    nominal: float
    borrowing_limit: float | None = None  # None: no limit
    lending_limit: float | None = None  # None: all of its idle nominal


NO_QUOTA = Quota(0)


@dataclass(frozen=True, slots=True)
class QueueSpec:
    tenant_id: int
    name: str  # the tenant's slug, for the words
    cohort: str | None = None
    weight: float = 1.0
    quotas: Mapping[str, Quota] = field(default_factory=dict)

    def quota(self, gpu_type: str) -> Quota:
        return self.quotas.get(gpu_type, NO_QUOTA)


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    borrowed: float = 0.0  # cards of this placement above the tenant's nominal
    reason: str = ""  # when refused: over_nominal, borrowing_limit, cohort_exhausted
    words: str = ""
    detail: Mapping = field(default_factory=dict)


ADMITTED = Admission(True)


def decayed(usage: float, elapsed_seconds: float, half_life_seconds: float) -> float:
    """`usage` after `elapsed_seconds` of decay with the given half-life."""
    if half_life_seconds <= 0:
        return 0.0
    return usage * math.pow(0.5, max(elapsed_seconds, 0.0) / half_life_seconds)


def _cards(value: float) -> str:
    return f"{value:g}" if abs(value - round(value)) > EPSILON else str(round(value))


class QueueBook:
    """A cycle's accounting of the queues: the cards each tenant holds per type now
    (`used`), taken as the cycle admits placements, and each tenant's decayed usage above
    nominal (`history`, card-seconds), for the fair-share order."""

    def __init__(
        self,
        specs: Iterable[QueueSpec],
        used: Mapping[tuple[int, str], float] | None = None,
        history: Mapping[int, float] | None = None,
    ):
        self.specs: dict[int, QueueSpec] = {spec.tenant_id: spec for spec in specs}
        self.used: dict[tuple[int, str], float] = dict(used or {})
        self.history: dict[int, float] = dict(history or {})
        # per (cohort, type): the tenant whose placement within its nominal found no room
        # this cycle; until the cycle ends, nobody in that cohort borrows that type (the
        # cards that free up are its own, not the next borrower's)
        self.waiting: dict[tuple[str, str], str] = {}
        # per (cohort, type): the tenants that borrowed it in this cycle, in the order they
        # did (the fair-share order): named to a borrower that found no room after them
        self.borrowers: dict[tuple[str, str], list[str]] = {}
        self.cohorts: dict[str, list[QueueSpec]] = {}
        for spec in self.specs.values():
            if spec.cohort:
                self.cohorts.setdefault(spec.cohort, []).append(spec)

    # --- what each tenant holds -----------------------------------------------------

    def holds(self, tenant_id: int, gpu_type: str) -> float:
        return self.used.get((tenant_id, gpu_type), 0.0)

    def above_nominal(self, tenant_id: int, gpu_type: str) -> float:
        spec = self.specs.get(tenant_id)
        if spec is None:
            return 0.0
        return max(self.holds(tenant_id, gpu_type) - spec.quota(gpu_type).nominal, 0.0)

    def idle_lendable(self, spec: QueueSpec, gpu_type: str) -> float:
        """What `spec` lends of type `gpu_type` now: its idle nominal, up to its limit."""
        quota = spec.quota(gpu_type)
        idle = max(quota.nominal - self.holds(spec.tenant_id, gpu_type), 0.0)
        return idle if quota.lending_limit is None else min(idle, quota.lending_limit)

    def cohort_lendable(self, cohort: str, gpu_type: str, *, besides: int | None = None) -> float:
        return sum(
            self.idle_lendable(spec, gpu_type) for spec in self.cohorts.get(cohort, ()) if spec.tenant_id != besides
        )

    def cohort_borrowed(self, cohort: str, gpu_type: str, *, besides: int | None = None) -> float:
        return sum(
            self.above_nominal(spec.tenant_id, gpu_type)
            for spec in self.cohorts.get(cohort, ())
            if spec.tenant_id != besides
        )

    def dominant_share(self, tenant_id: int) -> float:
        """Decayed usage above nominal over weight: lower goes first among borrowers."""
        spec = self.specs.get(tenant_id)
        if spec is None:
            return 0.0
        return self.history.get(tenant_id, 0.0) / max(spec.weight, EPSILON)

    # --- deciding ---------------------------------------------------------------------

    def admit(self, tenant_id: int, gpu_type: str, cards: float) -> Admission:
        """Whether `cards` more of `gpu_type` for the tenant are admitted (nothing taken:
        `take` does that once the placement is made)."""
        spec = self.specs.get(tenant_id)
        if spec is None or cards <= 0:
            return ADMITTED
        quota = spec.quota(gpu_type)
        held = self.holds(tenant_id, gpu_type)
        after = held + cards
        if after <= quota.nominal + EPSILON:
            return ADMITTED
        borrowed = after - max(quota.nominal, held)  # of this placement, above nominal
        above = after - quota.nominal  # the tenant's whole borrowing after it
        base = {
            "tenant": spec.name,
            "gpu_type": gpu_type,
            "nominal": quota.nominal,
            "used": held,
            "asked": cards,
        }
        at = f"{spec.name} is at {_cards(held)}/{_cards(quota.nominal)} nominal {gpu_type}"
        if not spec.cohort:
            return Admission(
                False,
                borrowed,
                "over_nominal",
                f"{at}, and it is in no cohort to borrow from",
                base | {"cohort": None},
            )
        if quota.borrowing_limit is not None and above > quota.borrowing_limit + EPSILON:
            return Admission(
                False,
                borrowed,
                "borrowing_limit",
                f"{at}, and borrowing {_cards(above)} would pass its borrowing limit of "
                f"{_cards(quota.borrowing_limit)}",
                base | {"cohort": spec.cohort, "borrowing_limit": quota.borrowing_limit},
            )
        waiter = self.waiting.get((spec.cohort, gpu_type))
        if waiter is not None:
            return Admission(
                False,
                borrowed,
                "nominal_waits",
                f"{at}, and {waiter}'s work within its nominal waits for {gpu_type} cards in the cohort {spec.cohort}",
                base | {"cohort": spec.cohort, "waiting": waiter},
            )
        lendable = self.cohort_lendable(spec.cohort, gpu_type, besides=tenant_id)
        borrowed_by_others = self.cohort_borrowed(spec.cohort, gpu_type, besides=tenant_id)
        free_to_lend = max(lendable - borrowed_by_others, 0.0)
        if above > free_to_lend + EPSILON:
            left = max(free_to_lend - max(held - quota.nominal, 0.0), 0.0)  # besides what it borrows already
            return Admission(
                False,
                borrowed,
                "cohort_exhausted",
                f"{at}, and the cohort {spec.cohort} has {_cards(left)} idle {gpu_type} cards to lend",
                base | {"cohort": spec.cohort, "lendable": left},
            )
        return Admission(True, borrowed)

    def found_no_room(self, tenant_id: int, gpu_type: str, cards: float) -> None:
        """A placement of the tenant found no room: when it was within its nominal, its
        cohort borrows no more of that type in this cycle."""
        spec = self.specs.get(tenant_id)
        if spec is not None and spec.cohort and gpu_type and not self.borrows(tenant_id, gpu_type, cards):
            self.waiting.setdefault((spec.cohort, gpu_type), spec.name)

    def take(self, tenant_id: int, gpu_type: str, cards: float) -> None:
        key = (tenant_id, gpu_type)
        spec = self.specs.get(tenant_id)
        if spec is not None and spec.cohort and self.borrows(tenant_id, gpu_type, cards):
            ahead = self.borrowers.setdefault((spec.cohort, gpu_type), [])
            if spec.name not in ahead:
                ahead.append(spec.name)
        self.used[key] = self.used.get(key, 0.0) + cards

    def behind(self, tenant_id: int, gpu_type: str, cards: float) -> Admission | None:
        """A borrower's placement that found no room, after others of its cohort borrowed
        that type in this cycle before it in the fair-share order: the words and figures
        that say so. None when it would not borrow, or nobody came before it."""
        spec = self.specs.get(tenant_id)
        if spec is None or not spec.cohort or not gpu_type or not self.borrows(tenant_id, gpu_type, cards):
            return None
        ahead = [name for name in self.borrowers.get((spec.cohort, gpu_type), ()) if name != spec.name]
        if not ahead:
            return None
        quota = spec.quota(gpu_type)
        held = self.holds(tenant_id, gpu_type)
        tenants = f"{len(ahead)} tenant{'s' if len(ahead) > 1 else ''}"
        return Admission(
            False,
            cards,
            "behind_in_fair_share",
            f"{spec.name} is at {_cards(held)}/{_cards(quota.nominal)} nominal {gpu_type}, and {tenants} "
            f"({', '.join(ahead)}) came before it in fair share for the cohort {spec.cohort}'s idle cards",
            {
                "tenant": spec.name,
                "gpu_type": gpu_type,
                "nominal": quota.nominal,
                "used": held,
                "asked": cards,
                "cohort": spec.cohort,
                "ahead": ahead,
            },
        )

    def give_back(self, tenant_id: int, gpu_type: str, cards: float) -> None:
        key = (tenant_id, gpu_type)
        self.used[key] = max(self.used.get(key, 0.0) - cards, 0.0)

    def borrows(self, tenant_id: int, gpu_type: str, cards: float) -> bool:
        """Whether `cards` more would take the tenant above its nominal (the placement
        then waits its turn in the fair-share order)."""
        spec = self.specs.get(tenant_id)
        if spec is None:
            return False
        return self.holds(tenant_id, gpu_type) + cards > spec.quota(gpu_type).nominal + EPSILON

    def may_reclaim(self, tenant_id: int, gpu_type: str, cards: float) -> bool:
        """Whether a placement refused for room may reclaim: it keeps its tenant within
        nominal, and someone in the cohort borrows that type now."""
        spec = self.specs.get(tenant_id)
        if spec is None or not spec.cohort or self.borrows(tenant_id, gpu_type, cards):
            return False
        return self.cohort_borrowed(spec.cohort, gpu_type, besides=tenant_id) > EPSILON


@dataclass(frozen=True, slots=True)
class Work:
    """Work that holds cards, as a reclaim sees it."""

    id: int
    tenant_id: int
    gpu_type: str
    cards: float
    priority: int
    started_at: float  # a timestamp: later is newer


def borrowed_work(book: QueueBook, works: Iterable[Work]) -> list[Work]:
    """The work that runs above its tenant's nominal: per tenant and type, its newest
    work beyond what fills the nominal oldest first. A tenant with no queue borrows
    nothing."""
    by_owner: dict[tuple[int, str], list[Work]] = {}
    for work in works:
        if work.tenant_id in book.specs:
            by_owner.setdefault((work.tenant_id, work.gpu_type), []).append(work)
    borrowed = []
    for (tenant_id, gpu_type), owned in by_owner.items():
        room = book.specs[tenant_id].quota(gpu_type).nominal
        for work in sorted(owned, key=lambda w: (w.started_at, w.id)):
            if room + EPSILON >= work.cards:
                room -= work.cards
            else:
                room = 0.0  # the nominal is filled: this and all newer work is borrowed
                borrowed.append(work)
    return borrowed


def reclaim_order(book: QueueBook, tenant_id: int, gpu_type: str, works: Iterable[Work]) -> list[Work]:
    """The work a reclaim for `tenant_id` may stop, in the order it stops it: the cohort's
    other members' borrowed work of that type, lowest priority first, then newest first.
    Work within a borrower's nominal is never in it."""
    spec = book.specs.get(tenant_id)
    if spec is None or not spec.cohort:
        return []
    members = {member.tenant_id for member in book.cohorts.get(spec.cohort, ())} - {tenant_id}
    candidates = [
        work for work in borrowed_work(book, works) if work.tenant_id in members and work.gpu_type == gpu_type
    ]
    return sorted(candidates, key=lambda w: (w.priority, -w.started_at, -w.id))


def fair_order(book: QueueBook, tenant_ids: Iterable[int]) -> list[int]:
    """Tenants that must borrow, lowest dominant share first (ties: tenant id)."""
    return sorted(set(tenant_ids), key=lambda tenant_id: (book.dominant_share(tenant_id), tenant_id))


# --- in the cycle ---------------------------------------------------------------------------

QUEUE_LIMIT = "QueueLimit"  # a failure's code: the tenant's queue did not admit it
ORDER_HORIZON_SECONDS = 3600.0  # the order counts what a borrower takes now as an hour of it


def demand(item) -> tuple[int, str, float]:
    """(tenant, GPU type or "" when any vendor will do, whole cards) of a queue item: a
    single task (TaskReq; a share of a card counts 0 here, its share once placed) or a
    group (GroupReq: every worker's cards)."""
    members = getattr(item, "members", None)
    if members is not None:
        return item.tenant_id, item.gpu_type, float(len(members) * item.gpus_per_worker)
    return item.tenant_id, item.gpu_type, float(item.gpu_required)


def fair_share_order(queue: Sequence, book: QueueBook) -> list:
    """The queue as the cycle should try it: first the items that keep their tenant within
    nominal (or whose tenant has no queue, or that name no GPU type), the tenants furthest
    below their nominal first (held / nominal, so a small nominal that large tasks leave
    part idle is filled before a large one), in queue order within that; then the items
    that would borrow, tenants interleaved by fair share: each next item
    from the tenant whose dominant share is lowest, counting what the items before it in
    this order would borrow (ORDER_HORIZON_SECONDS of their cards) on top of its past."""
    within, borrowing = [], {}
    asked: dict[tuple[int, str], float] = {}
    for item in queue:
        tenant_id, gpu_type, cards = demand(item)
        spec = book.specs.get(tenant_id)
        if spec is None or not gpu_type or not spec.cohort:
            within.append(item)
            continue
        key = (tenant_id, gpu_type)
        asked[key] = asked.get(key, book.holds(tenant_id, gpu_type)) + cards
        if asked[key] <= spec.quota(gpu_type).nominal + EPSILON:
            within.append(item)
        else:
            borrowing.setdefault(tenant_id, []).append(item)
    ordered = []
    usage = {tenant_id: book.history.get(tenant_id, 0.0) for tenant_id in borrowing}
    heads = {tenant_id: 0 for tenant_id in borrowing}
    while heads:
        tenant_id = min(heads, key=lambda t: (usage[t] / max(book.specs[t].weight, EPSILON), t))
        item = borrowing[tenant_id][heads[tenant_id]]
        ordered.append(item)
        usage[tenant_id] += demand(item)[2] * ORDER_HORIZON_SECONDS
        heads[tenant_id] += 1
        if heads[tenant_id] == len(borrowing[tenant_id]):
            del heads[tenant_id]

    def deficit_first(item):
        tenant_id, gpu_type, _ = demand(item)
        spec = book.specs.get(tenant_id)
        if spec is None or not gpu_type or not spec.quota(gpu_type).nominal:
            return 1.0
        return min(book.holds(tenant_id, gpu_type) / spec.quota(gpu_type).nominal, 1.0)

    within.sort(key=deficit_first)  # stable: in queue order within each level
    return within + ordered


def admitted_types(
    book: QueueBook, tenant_id: int, gpu_types: Sequence[str], cards: float
) -> tuple[list[str], Admission]:
    """Of `gpu_types`, those the tenant's queue admits `cards` more of; and the first
    refusal (ADMITTED when none refused)."""
    admitted, refusal = [], ADMITTED
    for gpu_type in gpu_types:
        verdict = book.admit(tenant_id, gpu_type, cards)
        if verdict.admitted:
            admitted.append(gpu_type)
        elif refusal.admitted:
            refusal = verdict
    return admitted, refusal


def holdings_of(nodes: Iterable) -> dict[tuple[int, str], float]:
    """The cards each tenant holds per GPU type in a snapshot (NodeSnap), a shared card as
    its share, by the ledger's rule (apps.scheduler.ledger.card_share_sql)."""
    used: dict[tuple[int, str], float] = {}
    for node in nodes:
        for gpu in node.gpus:
            for _, tenant_id, memory in gpu.holders:
                if tenant_id is None:
                    continue
                share = (
                    1.0 if memory is None else (min(1.0, memory / gpu.memory_total_mb) if gpu.memory_total_mb else 1.0)
                )
                key = (tenant_id, gpu.vendor.lower())
                used[key] = used.get(key, 0.0) + share
    return used


def card_share(gpu, memory_mb: int | None) -> float:
    """What a holder of `memory_mb` (None: the whole card) holds of `gpu` (a GpuSnap), as
    the ledger counts it (apps.scheduler.ledger.card_share_sql): a whole card 1, a share
    its memory over the card's, at most 1 (1 while the card's size is unknown)."""
    if memory_mb is None or not gpu.memory_total_mb:
        return 1.0
    return min(1.0, memory_mb / gpu.memory_total_mb)
