"""The scheduler's shell: load a snapshot in a few queries, let the pure core decide,
bind each decision in its own transaction (node row locked, cards re-checked, CAS
pending → scheduled, ledger rows), and record why the others did not fit."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import combinations

from django.db import transaction
from django.db.models import Q

from apps.core.cas import transition
from apps.core.clock import utcnow
from apps.nodes.models import Gpu, Node
from apps.scheduler.core import SCHEDULABLE_STATUSES, Decision, GpuSnap, NodeSnap, PluginSettings, TaskReq, place
from apps.scheduler.models import GpuAllocation, PluginConfig, QueueCursor
from apps.tasks.choices import TRANSITIONS, TaskStatus as S
from apps.tasks.models import Task
from apps.tenants.models import TenantGroup

BATCH_SIZE = 200


# --- configuration ----------------------------------------------------------------------


def plugin_settings() -> PluginSettings:
    configs = {config.name: config for config in PluginConfig.objects.all()}
    binpack = configs.get("binpack")
    layout = "binpack" if binpack is not None and binpack.enabled else "spread"
    enabled = frozenset(name for name in ("topology", "rdma") if configs.get(name) is None or configs[name].enabled)
    weights = {name: configs[name].weight if name in configs else 1.0 for name in ("spread", "binpack", "topology", "rdma")}
    return PluginSettings(layout=layout, weights=weights, enabled=enabled)


def sharing_rule():
    """tenants_may_share for a whole cycle, from one query (fail-closed: a tenant in no
    group shares with nobody but itself)."""
    pairs = set()
    for group in TenantGroup.objects.prefetch_related("tenants"):
        members = sorted(tenant.pk for tenant in group.tenants.all())
        pairs.update(combinations(members, 2))

    def may_share(a: int, b: int) -> bool:
        return a == b or (min(a, b), max(a, b)) in pairs

    return may_share


# --- the snapshot -----------------------------------------------------------------------


def load_nodes() -> list[NodeSnap]:
    nodes = {
        row["id"]: NodeSnap(
            id=row["id"], status=row["status"], executable=row["executable"], tenant_id=row["tenant_id"],
            labels=row["labels"] or {}, region=row["region"], zone=row["zone"], rack=row["rack"],
            cpu_used=row["cpu_used"], memory_used=row["memory_used"],
        )
        for row in Node.objects.filter(status__in=SCHEDULABLE_STATUSES, executable=True).values(
            "id", "status", "executable", "tenant_id", "labels", "region", "zone", "rack", "cpu_used", "memory_used"
        )
    }
    cards: dict[tuple[str, int], GpuSnap] = {}
    for row in Gpu.objects.filter(node_id__in=nodes).order_by("node_id", "index").values(
        "node_id", "index", "vendor", "memory_total_mb", "memory_used_mb", "lost_at"
    ):
        gpu = GpuSnap(row["index"], row["vendor"], row["memory_total_mb"], lost=row["lost_at"] is not None,
                      memory_used_mb=row["memory_used_mb"])
        nodes[row["node_id"]].gpus.append(gpu)
        cards[(row["node_id"], row["index"])] = gpu
    for node_id, index, task_id, tenant_id, memory in GpuAllocation.objects.filter(node_id__in=nodes).values_list(
        "node_id", "gpu_index", "task_id", "tenant_id", "memory_mb"
    ):
        card = cards.get((node_id, index))
        if card is not None:
            card.holders.append((task_id, tenant_id, memory))
    return list(nodes.values())


def next_batch(size: int = BATCH_SIZE) -> list[Task]:
    """The next `size` pending tasks in queue order after the cursor, wrapping around."""
    pending = Task.objects.filter(status=S.PENDING).in_queue_order()
    cursor = QueueCursor.objects.filter(pk=1).first()
    batch: list[Task] = []
    if cursor and cursor.task_id is not None:
        after = (
            Q(priority__lt=cursor.priority)
            | Q(priority=cursor.priority, created_at__gt=cursor.created_at)
            | Q(priority=cursor.priority, created_at=cursor.created_at, id__gt=cursor.task_id)
        )
        batch = list(pending.filter(after)[:size])
    if len(batch) < size:
        seen = {task.pk for task in batch}
        batch += [task for task in pending[: size - len(batch)] if task.pk not in seen]
    if batch:
        last = batch[-1]
        QueueCursor.objects.update_or_create(pk=1, defaults={"priority": last.priority, "created_at": last.created_at, "task_id": last.pk})
    return batch


def as_request(task: Task) -> TaskReq:
    return TaskReq(
        id=task.pk, tenant_id=task.tenant_id, gpu_required=task.gpu_required, gpu_memory_mb=task.gpu_memory_mb,
        gpu_type=task.gpu_type, priority=task.priority, labels=task.labels or {},
    )


# --- bind -------------------------------------------------------------------------------


def bind(decision: Decision, task: Task, may_share) -> bool:
    """One decision, all or nothing. False: the world changed since the snapshot (the
    task was taken or cancelled, the node went away, a card got a holder); the task
    stays pending for the next cycle."""
    with transaction.atomic():
        if not Node.objects.select_for_update().filter(
            pk=decision.node_id, status__in=SCHEDULABLE_STATUSES, executable=True
        ).exists():
            return False
        holders = list(
            GpuAllocation.objects.filter(node_id=decision.node_id, gpu_index__in=decision.gpu_indices)
            .values_list("gpu_index", "tenant_id", "memory_mb")
        )
        if decision.memory_mb is None and holders:
            return False
        if decision.memory_mb is not None:
            if any(memory is None for _, _, memory in holders):
                return False
            if not all(may_share(task.tenant_id, tenant_id) for _, tenant_id, _ in holders):
                return False
        if not transition(Task, TRANSITIONS, task.pk, [S.PENDING], S.SCHEDULED, node_id=decision.node_id, schedule_reason={}):
            return False
        GpuAllocation.objects.bulk_create(
            GpuAllocation(task_id=task.pk, node_id=decision.node_id, gpu_index=index, tenant_id=task.tenant_id,
                          memory_mb=decision.memory_mb)
            for index in decision.gpu_indices
        )
    return True


def release(task_ids) -> int:
    """Give back what tasks held (terminal, or back to the queue)."""
    deleted, _ = GpuAllocation.objects.filter(task_id__in=list(task_ids)).delete()
    return deleted


# --- one cycle --------------------------------------------------------------------------


@dataclass
class CycleResult:
    considered: int = 0
    bound: list[int] = field(default_factory=list)
    lost_races: list[int] = field(default_factory=list)
    failed: dict[int, dict] = field(default_factory=dict)
    backlog: bool = False


def run_cycle(batch_size: int = BATCH_SIZE) -> CycleResult:
    result = CycleResult()
    batch = next_batch(batch_size)
    result.considered = len(batch)
    if not batch:
        return result
    result.backlog = Task.objects.filter(status=S.PENDING).count() > len(batch)
    may_share = sharing_rule()
    decisions, failures = place([as_request(task) for task in batch], load_nodes(), plugin_settings(), may_share)
    tasks = {task.pk: task for task in batch}
    for decision in decisions:
        (result.bound if bind(decision, tasks[decision.task_id], may_share) else result.lost_races).append(decision.task_id)
    now = utcnow().isoformat()
    reasons = []
    for failure in failures:
        task = tasks[failure.task_id]
        task.schedule_reason = failure.as_reason() | {"at": now}
        result.failed[task.pk] = task.schedule_reason
        reasons.append(task)
    Task.objects.bulk_update(reasons, ["schedule_reason"])
    return result
