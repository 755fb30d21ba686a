"""The scheduler's shell: load a snapshot in a few queries, let the pure core decide,
bind the cycle's decisions in one transaction (nodes locked, cards re-checked against
the live ledger, one multi-row CAS pending → scheduled, ledger rows), and record why
the other tasks did not fit."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import combinations

from django.db import connection, transaction
from django.db.models import Q

from apps.core.cas import check_transition
from apps.core.errors import Conflict
from apps.core.clock import utcnow
from apps.nodes.models import Gpu, Node
from apps.scheduler.core import SCHEDULABLE_STATUSES, Decision, GpuSnap, NodeSnap, PluginSettings, TaskReq, place
from apps.scheduler.models import GpuAllocation, PluginConfig, QueueCursor
from apps.tasks.choices import TRANSITIONS, TaskStatus as S
from apps.tasks.models import Task
from apps.tenants.models import TenantGroup

BATCH_SIZE = 200


# --- configuration ----------------------------------------------------------------------


@dataclass(frozen=True)
class PluginSpec:
    name: str
    kind: str  # "filter" or "score"
    default_enabled: bool
    locked: bool = False  # correctness plugins: always on
    exclusive_with: str = ""


# The plugins the scheduler runs today, in pipeline order. (preempt arrives with the
# rest of the scheduler issue; it is not listed until it runs.)
PLUGINS: dict[str, PluginSpec] = {
    spec.name: spec
    for spec in (
        PluginSpec("gpu-filter", "filter", True, locked=True),
        PluginSpec("resource-filter", "filter", True, locked=True),
        PluginSpec("spread", "score", True, exclusive_with="binpack"),
        PluginSpec("binpack", "score", False, exclusive_with="spread"),
        PluginSpec("topology", "score", True),
        PluginSpec("rdma", "score", True),
        PluginSpec("nvlink", "score", True),
    )
}


def plugin_table() -> list[dict]:
    """The effective configuration: stored rows over defaults. The scheduler reads this
    very function every cycle, so the API can never show a set it does not use."""
    stored = {config.name: config for config in PluginConfig.objects.filter(name__in=PLUGINS)}
    table = []
    for name, spec in PLUGINS.items():
        config = stored.get(name)
        enabled = True if spec.locked else (config.enabled if config else spec.default_enabled)
        table.append({
            "name": name, "kind": spec.kind, "enabled": enabled, "locked": spec.locked,
            "weight": config.weight if config else 1.0, "extra": config.extra if config else {},
        })
    return table


def plugin_settings() -> PluginSettings:
    table = {row["name"]: row for row in plugin_table()}
    layout = "binpack" if table["binpack"]["enabled"] else "spread"
    enabled = frozenset(name for name in ("topology", "rdma", "nvlink") if table[name]["enabled"])
    weights = {name: table[name]["weight"] for name in ("spread", "binpack", "topology", "rdma", "nvlink")}
    thresholds = {
        field: float(value)
        for field, value in table["resource-filter"]["extra"].items()
        if field in THRESHOLD_FIELDS and isinstance(value, (int, float))
    }
    return PluginSettings(layout=layout, weights=weights, enabled=enabled, **thresholds)


# Load thresholds, configurable as the resource-filter plugin's `extra`.
THRESHOLD_FIELDS = ("cpu_percent_max", "memory_percent_max", "gpu_memory_percent_max", "gpu_utilization_max", "gpu_temperature_max")


def set_plugin_enabled(name: str, enabled: bool) -> None:
    """Enable or disable a plugin. The layout plugins are exclusive: enabling one
    disables the other, and disabling one enables the other (there is always a layout)."""
    spec = PLUGINS[name]
    if spec.locked:
        raise Conflict(f"'{name}' keeps the scheduler correct and cannot be disabled or enabled.", "plugin_locked")
    with transaction.atomic():
        PluginConfig.objects.update_or_create(name=name, defaults={"enabled": enabled})
        if spec.exclusive_with:
            PluginConfig.objects.update_or_create(name=spec.exclusive_with, defaults={"enabled": not enabled})


def set_plugin_options(name: str, *, weight: float | None = None, extra: dict | None = None) -> None:
    defaults = {}
    if weight is not None:
        defaults["weight"] = weight
    if extra is not None:
        defaults["extra"] = extra
    if defaults:
        row, created = PluginConfig.objects.get_or_create(name=name, defaults={"enabled": PLUGINS[name].default_enabled, **defaults})
        if not created:
            for field, value in defaults.items():
                setattr(row, field, value)
            row.save()


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
        "node_id", "index", "vendor", "memory_total_mb", "memory_used_mb", "utilization", "temperature", "lost_at"
    ):
        gpu = GpuSnap(row["index"], row["vendor"], row["memory_total_mb"], lost=row["lost_at"] is not None,
                      memory_used_mb=row["memory_used_mb"], utilization=row["utilization"], temperature=row["temperature"])
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


BIND_CAS = """
    UPDATE tasks AS t SET status = %s, node_id = v.node_id, schedule_reason = '{}'::jsonb, updated_at = %s
    FROM unnest(%s::bigint[], %s::text[]) AS v(id, node_id)
    WHERE t.id = v.id AND t.status = %s
    RETURNING t.id
"""


def bind_all(decisions: list[Decision], tasks: dict[int, Task], may_share, settings: PluginSettings | None = None) -> tuple[list[int], list[int]]:
    """Bind a cycle's decisions in one transaction: lock their nodes (in id order, so
    concurrent schedulers queue rather than deadlock), drop the decisions the live ledger
    now contradicts (a node gone, a card taken, a holder this tenant may not share with),
    move the rest pending → scheduled in one multi-row compare-and-set, and write the
    ledger rows of the winners. Returns (bound, lost)."""
    if not decisions:
        return [], []
    check_transition(TRANSITIONS, [S.PENDING], S.SCHEDULED)
    with transaction.atomic():
        node_ids = sorted({d.node_id for d in decisions})
        settings = settings or PluginSettings()
        # the load thresholds again, on the node rows as they are now
        alive = set(
            Node.objects.select_for_update()
            .filter(pk__in=node_ids, status__in=SCHEDULABLE_STATUSES, executable=True)
            .exclude(Q(cpu_used__gte=settings.cpu_percent_max) | Q(memory_used__gte=settings.memory_percent_max))
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        holders = defaultdict(list)
        for node_id, index, tenant_id, memory in GpuAllocation.objects.filter(node_id__in=alive).values_list(
            "node_id", "gpu_index", "tenant_id", "memory_mb"
        ):
            holders[(node_id, index)].append((tenant_id, memory))
        still_valid = []
        for decision in decisions:
            task = tasks[decision.task_id]
            cards = [holders[(decision.node_id, index)] for index in decision.gpu_indices]
            if decision.node_id not in alive:
                continue
            if decision.memory_mb is None and any(cards):
                continue
            if decision.memory_mb is not None and any(
                memory is None or not may_share(task.tenant_id, tenant_id) for card in cards for tenant_id, memory in card
            ):
                continue
            still_valid.append(decision)
        with connection.cursor() as cursor:
            cursor.execute(BIND_CAS, [
                S.SCHEDULED, utcnow(), [d.task_id for d in still_valid], [d.node_id for d in still_valid], S.PENDING,
            ])
            won = {row[0] for row in cursor.fetchall()}
        GpuAllocation.objects.bulk_create(
            GpuAllocation(task_id=d.task_id, node_id=d.node_id, gpu_index=index, tenant_id=tasks[d.task_id].tenant_id,
                          memory_mb=d.memory_mb)
            for d in still_valid if d.task_id in won
            for index in d.gpu_indices
        )
    bound = [d.task_id for d in decisions if d.task_id in won]
    return bound, [d.task_id for d in decisions if d.task_id not in won]


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
    settings = plugin_settings()
    decisions, failures = place([as_request(task) for task in batch], load_nodes(), settings, may_share)
    tasks = {task.pk: task for task in batch}
    result.bound, result.lost_races = bind_all(decisions, tasks, may_share, settings)
    now = utcnow().isoformat()
    reasons = []
    for failure in failures:
        task = tasks[failure.task_id]
        task.schedule_reason = failure.as_reason() | {"at": now}
        result.failed[task.pk] = task.schedule_reason
        reasons.append(task)
    Task.objects.bulk_update(reasons, ["schedule_reason"])
    return result
