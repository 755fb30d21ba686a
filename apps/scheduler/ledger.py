"""The GPU ledger's writes: cards taken at bind, given back when a task leaves its node.

It imports only models (and the schema layer's carbon rule), so both sides of the ledger
can use it without a cycle: the scheduler's bind writes the rows (ALLOCATE, in bind's
transaction) and every task move off a node (apps.tasks.services.move_tasks) deletes
them, in the move's transaction.

Energy (docs/energy.md#tasks): a row keeps its card's energy accumulator
(gpus.energy_wh) as it was at bind, read by the same INSERT; what the accumulator grew
while the task held the card, times the task's share of it, is the task's. HELD_ENERGY
is that growth per held card, for the release (apps.tasks.services) and for the running
tasks' live figures (apps.tasks.selectors).
"""

from __future__ import annotations

from apps.nodes.carbon import factor_sql, region_factor_join
from apps.scheduler.models import GpuAllocation

# One row per (task, card); the winners of bind's multi-row CAS, in the same statement
# batch. The card's accumulator at bind comes from the gpus row in the same statement.
ALLOCATE = (
    "\n"
    "    INSERT INTO gpu_allocations (task_id, node_id, gpu_index, tenant_id, memory_mb, created_at, "
    "energy_wh_at_bind)\n"
    "    SELECT v.task_id, v.node_id, v.gpu_index, v.tenant_id, v.memory_mb, %s,\n"
    "           (SELECT g.energy_wh FROM gpus AS g WHERE g.node_id = v.node_id AND g.index = v.gpu_index)\n"
    "    FROM unnest(%s::bigint[], %s::text[], %s::int[], %s::bigint[], %s::bigint[]) "
    "AS v(task_id, node_id, gpu_index, tenant_id, memory_mb)\n"
)


def card_share_sql(allocation: str, card: str) -> str:
    """SQL for the share of its card a ledger row holds: a whole card 1; a share its
    memory_mb over the card's memory_total_mb, at most 1 (the whole card while the card's
    size is not known: LEAST ignores a null). The energy of a task and the GPU-seconds of
    the gateway's requests (apps.gateway.catalog) both count by it."""
    return (
        f"CASE WHEN {allocation}.memory_mb IS NULL THEN 1.0 "
        f"ELSE LEAST(1.0, {allocation}.memory_mb::float8 / NULLIF({card}.memory_total_mb, 0)) END"
    )


# Per held card of the tasks in %(tasks)s: `wh`, the accumulator's growth since bind
# times the share (a whole card 1; a share its memory_mb / the card's memory_total_mb,
# at most 1); `measured`, whether the card measured power while held (its accumulator
# grew, or a power reading came after the bind); `factor`, the node's emission factor
# now (apps.nodes.carbon). A card with no accumulator at bind (held before energy was
# kept), a share of a card of unknown size, or a card since forgotten, is not counted.
HELD_ENERGY = f"""
    SELECT a.task_id,
           GREATEST(0, g.energy_wh - a.energy_wh_at_bind) * {card_share_sql("a", "g")} AS wh,
           (g.energy_wh > a.energy_wh_at_bind OR g.power_at >= a.created_at) AS measured,
           {factor_sql("n", "ef")} AS factor
    FROM gpu_allocations AS a
    JOIN gpus AS g ON g.node_id = a.node_id AND g.index = a.gpu_index
    JOIN nodes AS n ON n.id = a.node_id
    {region_factor_join("n", "ef")}
    WHERE a.task_id = ANY(%(tasks)s) AND a.energy_wh_at_bind IS NOT NULL
"""

# HELD_ENERGY summed per task: `wh` null when none of its cards measured power;
# `carbon_g` null when no factor covered any of it; `unfactored_wh` what no factor covered.
TASK_ENERGY = f"""
    SELECT task_id,
           sum(wh) FILTER (WHERE measured) AS wh,
           sum(wh * factor / 1000.0) FILTER (WHERE measured AND factor IS NOT NULL) AS carbon_g,
           COALESCE(sum(wh) FILTER (WHERE measured AND factor IS NULL), 0) AS unfactored_wh
    FROM ({HELD_ENERGY}) AS held
    WHERE wh IS NOT NULL
    GROUP BY task_id
"""


def release(task_ids) -> int:
    """Give back what tasks held (terminal, or back to the queue)."""
    deleted, _ = GpuAllocation.objects.filter(task_id__in=list(task_ids)).delete()
    return deleted
