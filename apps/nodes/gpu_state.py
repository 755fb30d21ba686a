"""A GPU's state, derived once for every reader: the API's presenter and /metrics (in
SQL), the portal, the admin and `Gpu.state` (in Python). The rule: a lost card is lost,
whoever holds it; a card cordoned
(its health, or an operator) is cordoned; a card the scheduler's ledger (gpu_allocations) has a holder on, whole
or a share, is busy; any other card is available. `gpu_state` is the rule, `state_sql`
the same rule as an SQL expression. Python readers get "held" for a whole list in the
query that reads the cards (`Gpu.objects.with_state()`), never with a query per card;
tests/nodes/test_gpu_state.py holds the two spellings and the pages to one answer."""

from __future__ import annotations

from apps.nodes.choices import GpuState


def gpu_state(*, lost: bool, held: bool, cordoned: bool = False) -> str:
    """Lost overrides; then cordoned (unhealthy or by an operator: no new placement,
    whoever still runs there); busy when the ledger has a holder on the card; else
    available."""
    if lost:
        return GpuState.LOST
    if cordoned:
        return GpuState.CORDONED
    return GpuState.BUSY if held else GpuState.AVAILABLE


def state_sql(gpu: str) -> str:
    """`gpu_state` for the `gpus` row aliased `gpu`, as an SQL expression."""
    held = f"EXISTS (SELECT 1 FROM gpu_allocations AS a WHERE a.node_id = {gpu}.node_id AND a.gpu_index = {gpu}.index)"
    return (
        f"CASE WHEN {gpu}.lost_at IS NOT NULL THEN '{GpuState.LOST.value}' "
        f"WHEN {gpu}.cordoned_at IS NOT NULL THEN '{GpuState.CORDONED.value}' "
        f"WHEN {held} THEN '{GpuState.BUSY.value}' "
        f"ELSE '{GpuState.AVAILABLE.value}' END"
    )
