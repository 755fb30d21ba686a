"""The one order in which node and card rows are locked (docs/architecture.md#lock-order).

The heartbeat writes its node's row, then its cards' rows by index, 2,000 times a second
on a large fleet. Any other writer that takes rows in another order can deadlock with it,
so every writer of node and card rows either:

- locks the node's row first, then its cards by index (what `lock_card` does for one
  card; several nodes: by node id, each node's cards by index), or
- takes its rows with SKIP LOCKED in that order (a sweep across nodes: a row a beat holds
  is picked up on the next run), or
- runs inside the beat's own statement (the memory drift judgement).
"""

from __future__ import annotations

from apps.nodes.models import Gpu, Node


def lock_node(node_id: str) -> bool:
    """The node's row, locked (FOR NO KEY UPDATE, as a beat's update takes it) until the
    transaction ends; False when there is no such node."""
    return bool(list(Node.objects.select_for_update(no_key=True).filter(pk=node_id).values_list("pk", flat=True)))


def lock_card(node_id: str, index: int) -> Gpu | None:
    """One card, locked after its node's row (the beat's order); None when it is not there."""
    lock_node(node_id)
    return Gpu.objects.select_for_update().filter(node_id=node_id, index=index).first()
