"""Reads of the slices shared by the API and the portal (docs/slices.md).

A tenant sees its own slices in full. On a card it shares, another tenant's slice is
shown only as carved memory (tier, QoS, state, memory): its tenant, task and ids are
left out, as the node pages show another tenant's GPU use without naming the task."""

from __future__ import annotations

from collections import defaultdict

from apps.nodes.models import Gpu
from apps.slices.choices import LIVE, QOS_OF_TIER
from apps.slices.models import Slice


def slice_list(slices, *, node_id: str = "", state: str = "", tier: str = "", task_id: int | None = None):
    """`slices`: a scoped queryset (Slice.objects.visible_to); filtered in SQL."""
    if node_id:
        slices = slices.filter(node_id=node_id)
    if state:
        slices = slices.filter(state=state)
    if tier:
        slices = slices.filter(tier=tier)
    if task_id is not None:
        slices = slices.filter(task_id=task_id)
    return slices.select_related("tenant", "task").order_by("-created_at", "-id")


def slice_summary(slice_: Slice, *, own: bool) -> dict:
    """One slice on a card as the node detail shows it; `own`: the caller may see it."""
    return {
        "id": slice_.pk if own else None,
        "tier": slice_.tier,
        "qos": QOS_OF_TIER[slice_.tier],
        "state": slice_.state,
        "memory_mb": slice_.memory_mb,
        "compute_percent": slice_.compute_percent,
        "profile": slice_.profile,
        "tenant": (slice_.tenant.slug if slice_.tenant_id else None) if own else None,
        "task_id": slice_.task_id if own else None,
        "task_name": (slice_.task.name if slice_.task_id else None) if own else None,
        "own": own,
    }


def slices_by_card(node, principal, *, shares: bool = False) -> dict[int, list[dict]]:
    """The LIVE slices on each card of `node` (gpu index → summaries, oldest first);
    `shares`: each with its `percent` of the card's memory too (for the pages' bars)."""
    visible = set(Slice.objects.visible_to(principal).filter(node=node, state__in=LIVE).values_list("pk", flat=True))
    cards: dict[int, list[dict]] = defaultdict(list)
    for slice_ in (
        Slice.objects.filter(node=node, state__in=LIVE).select_related("tenant", "task").order_by("gpu_index", "id")
    ):
        cards[slice_.gpu_index].append(slice_summary(slice_, own=slice_.pk in visible))
    if shares:
        totals = dict(Gpu.objects.filter(node=node).values_list("index", "memory_total_mb"))
        for index, items in cards.items():
            _add_shares(items, totals.get(index) or 0)
    return dict(cards)


def _add_shares(items: list[dict], total_mb: int) -> None:
    for item in items:
        item["percent"] = round(100 * item["memory_mb"] / total_mb, 1) if total_mb else None


def carved_cards(principal, *, node_id: str = "") -> list[dict]:
    """The cards carved into LIVE slices, for the portal's slices page: per node and
    card, its memory, the memory carved and the share of it, and the slices (the
    caller's in full, others' as carved memory). Operators see every carved card; a
    tenant the cards its own slices are on."""
    live = Slice.objects.filter(state__in=LIVE)
    if node_id:
        live = live.filter(node_id=node_id)
    mine = set(Slice.objects.visible_to(principal).filter(pk__in=live.values("pk")).values_list("pk", flat=True))
    rows = list(live.select_related("tenant", "task", "node").order_by("node_id", "gpu_index", "id"))
    cards_seen = {(s.node_id, s.gpu_index) for s in rows if s.pk in mine}
    totals = {
        (g.node_id, g.index): g
        for g in Gpu.objects.filter(node_id__in={node for node, _ in cards_seen}).only(
            "node_id", "index", "uuid", "model", "memory_total_mb"
        )
    }
    cards: dict[tuple[str, int], dict] = {}
    for slice_ in rows:
        key = (slice_.node_id, slice_.gpu_index)
        if key not in cards_seen:
            continue
        gpu = totals.get(key)
        card = cards.setdefault(
            key,
            {
                "node_id": slice_.node_id,
                "node_name": slice_.node.name,
                "gpu_index": slice_.gpu_index,
                "gpu_model": gpu.model if gpu else "",
                "memory_total_mb": (gpu.memory_total_mb if gpu else None) or 0,
                "carved_mb": 0,
                "slices": [],
            },
        )
        card["carved_mb"] += slice_.memory_mb
        card["slices"].append(slice_summary(slice_, own=slice_.pk in mine))
    out = list(cards.values())
    for card in out:
        total = card["memory_total_mb"]
        card["carved_percent"] = min(100, round(100 * card["carved_mb"] / total)) if total else None
        _add_shares(card["slices"], total)
    return out
