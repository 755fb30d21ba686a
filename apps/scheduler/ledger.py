"""The GPU ledger's writes: cards taken at bind, given back when a task leaves its node.

It imports only models, so both sides of the ledger can use it without a cycle: the
scheduler's bind writes the rows (ALLOCATE, in bind's transaction) and every task move
off a node (apps.tasks.services.move_tasks) deletes them, in the move's transaction.
"""

from __future__ import annotations

from apps.scheduler.models import GpuAllocation

# One row per (task, card); the winners of bind's multi-row CAS, in the same statement batch.
ALLOCATE = (
    "\n"
    "    INSERT INTO gpu_allocations (task_id, node_id, gpu_index, tenant_id, memory_mb, created_at)\n"
    "    SELECT v.task_id, v.node_id, v.gpu_index, v.tenant_id, v.memory_mb, %s\n"
    "    FROM unnest(%s::bigint[], %s::text[], %s::int[], %s::bigint[], %s::bigint[]) "
    "AS v(task_id, node_id, gpu_index, tenant_id, memory_mb)\n"
)


def release(task_ids) -> int:
    """Give back what tasks held (terminal, or back to the queue)."""
    deleted, _ = GpuAllocation.objects.filter(task_id__in=list(task_ids)).delete()
    return deleted
