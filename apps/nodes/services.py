"""State changes of nodes (other than the heartbeat's own hot path, in heartbeat.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from rest_framework.exceptions import NotFound

from apps.alerts import keys as alert_keys
from apps.alerts.services import recover_alert
from apps.confidential.services import record_audit
from apps.core.audit import record_operator_audit
from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.nodes import liveness
from apps.nodes.choices import CORDON_LABEL, NodeStatus
from apps.nodes.error_codes import NodeErrorCode
from apps.nodes.lock_order import lock_card
from apps.nodes.models import EmissionFactor, Gpu, Node
from apps.tasks.choices import ACTIVE, TaskStatus
from apps.tasks.models import Task
from apps.tasks.services import move_tasks, requeue_tasks

logger = logging.getLogger(__name__)

# liveness.status_at, set-wise, for the nodes silence may have moved: a beat writes its
# node's status itself (online, degraded, or offline after a farewell), so what is left to
# the checker is the silent nodes not yet offline, and those never heard from. They are
# found by the last-heartbeat index (work follows the silent nodes, not the fleet), taken
# in id order, skipping a row a beat holds: that node is not silent, and its beat writes
# its status (docs/architecture.md#lock-order).
REFRESH_STATUSES = f"""
    WITH computed AS (
        SELECT id, {liveness.STATUS_SQL} AS status
        FROM nodes
        WHERE status <> '{NodeStatus.OFFLINE}' AND (last_heartbeat_at IS NULL OR last_heartbeat_at <= %(suspect)s)
        ORDER BY id FOR NO KEY UPDATE SKIP LOCKED
    )
    UPDATE nodes AS n SET status = c.status FROM computed c
    WHERE n.id = c.id AND n.status <> c.status
    RETURNING n.id, n.status
"""


def refresh_node_statuses(now: datetime | None = None) -> dict[str, list[str]]:
    """The health checker: moves the silent nodes on (suspect, then offline), writing
    only the status column. Returns the changed node ids by new status, so per-change
    work is linear in changes, not in nodes."""
    now = now or utcnow()
    with connection.cursor() as cursor:
        cursor.execute(REFRESH_STATUSES, liveness.status_params(now))
        changed: dict[str, list[str]] = {}
        for node_id, status in cursor.fetchall():
            changed.setdefault(status, []).append(node_id)
    return changed


def active_tasks_on(node: Node) -> list[tuple[int, str]]:
    return list(Task.objects.filter(node=node, status__in=ACTIVE).order_by("id").values_list("id", "status"))


def check_no_active_tasks(node: Node) -> None:
    """The first pre-check of a node's deletion: refused while the node has active tasks,
    with no force (deleting it would strand them in running forever, holding quota)."""
    active = active_tasks_on(node)
    if active:
        listed = ", ".join(f"#{task_id} ({status})" for task_id, status in active[:50])
        raise Conflict(
            f"Node '{node.pk}' has active tasks: {listed}. Stop them first; force does not apply.",
            NodeErrorCode.NODE_HAS_ACTIVE_TASKS,
        )


# The other pre-checks of a node's deletion, each registered by the app whose rows stand
# on nodes (apps.inference: the models registered on it, from its AppConfig.ready), so
# that this layer never imports the ones above it. A check is called as
# check(node, force=..., principal=...) under the node's lock, in the deletion's
# transaction, after the active tasks' check: it refuses by raising (a Conflict; nothing
# is written), or, with force where it allows one, clears what it guards, and returns
# what the deletion's answer says of it (a dict merged into NodeDeleted.cleared).
DELETION_CHECKS: list[Callable[..., dict]] = []


def register_deletion_check(check: Callable[..., dict]) -> None:
    """Add a pre-check of every node's deletion (once, however often it is registered)."""
    if check not in DELETION_CHECKS:
        DELETION_CHECKS.append(check)


@dataclass(frozen=True)
class NodeDeleted:
    node_id: str
    cleared: dict  # what the pre-checks cleared with force (apps.inference: the models), for the answer


def delete_node(node: Node, *, force: bool = False, principal=None) -> NodeDeleted:
    """Delete the node, its cards and metrics; its finished tasks keep their history
    without it. In one transaction holding the node's row: refused while it has active
    tasks (force does not apply), then the registered pre-checks (DELETION_CHECKS), each
    of which refuses or, with `force`, clears what it guards; a refusal writes nothing.
    `principal` decides what the answer names (None: everything, the operators' admin).
    What the API, the portal and the admin call."""
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        check_no_active_tasks(locked)
        cleared: dict = {}
        for check in DELETION_CHECKS:
            cleared.update(check(locked, force=force, principal=principal))
        Task.objects.filter(node=locked).update(node=None)  # history keeps the task, not the node
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM node_metrics WHERE node_id = %s", [locked.pk])
        locked.delete()
    return NodeDeleted(node.pk, cleared)


def forget_lost_gpu(node: Node, index: int) -> None:
    """Remove a card that was taken out of the machine. Only a lost card can be removed:
    one the agent still reports would come back on the next beat."""
    with transaction.atomic():
        gpu = lock_card(node.pk, index)
        if gpu is None:
            raise NotFound(f"Node '{node.pk}' has no GPU {index}.")
        if gpu.lost_at is None:
            raise Conflict(
                f"GPU {index} of node '{node.pk}' is not lost; only lost cards can be removed.",
                NodeErrorCode.GPU_NOT_LOST,
            )
        gpu.delete()
        Node.objects.filter(pk=node.pk).update(gpu_count=Gpu.objects.filter(node=node).count())
        recover_alert(alert_keys.gpu_lost(node.pk, index))


LOCATION_FIELDS = ("region", "zone", "rack")


def set_location(node: Node, changes: dict[str, str]) -> Node:
    """Omitted fields are unchanged; an empty string clears. A narrow UPDATE, so it never
    races with heartbeats over other columns."""
    if changes:
        Node.objects.filter(pk=node.pk).update(**changes)
        for field, value in changes.items():
            setattr(node, field, value)
    return node


@dataclass(frozen=True)
class TenantAssigned:
    node: Node
    mode: str
    other_tenant_tasks: list[int]  # active tasks of other tenants on the node
    stopping: list[int]  # those asked to stop (evict)


def assign_tenant(node: Node, tenant, *, expected_version: int, mode: str = "drain") -> TenantAssigned:
    """Dedicate the node to `tenant` (or make it shared with None). Optimistic concurrency:
    a stale `expected_version` is a conflict. Other tenants' active tasks are left to finish
    (drain) or asked to stop (evict)."""
    with transaction.atomic():
        updated = Node.objects.filter(pk=node.pk, version=expected_version).update(
            tenant=tenant, version=expected_version + 1
        )
        if not updated:
            raise Conflict(
                "The node was changed by someone else; reload it and try again.", NodeErrorCode.STALE_VERSION
            )
        others = Task.objects.filter(node=node, status__in=ACTIVE)
        if tenant is not None:
            others = others.exclude(tenant=tenant)
        else:
            others = others.none()
        other_ids = list(others.order_by("id").values_list("id", flat=True))
        stopping: list[int] = []
        if mode == "evict" and other_ids:
            stopping = sorted(
                move_tasks(
                    other_ids, (TaskStatus.SCHEDULED, TaskStatus.STARTING, TaskStatus.RUNNING), TaskStatus.STOPPING
                )
            )
    node.refresh_from_db()
    return TenantAssigned(node, mode, other_ids, stopping)


def upsert_node(node_id: str, fields: dict) -> tuple[Node, bool]:
    """The operators' manual create/update (POST /api/v1/nodes). Agents register by
    heartbeat; this corrects or pre-registers a node. Labels merge by key, as a beat's do.
    A key set here is no longer the agent's to remove (see heartbeat.label_ownership)."""
    with transaction.atomic():
        node, created = Node.objects.select_for_update().get_or_create(
            pk=node_id, defaults={"name": fields.get("name") or f"agent-{node_id}", **fields}
        )
        if not created and fields:
            if "labels" in fields:
                agents = [key for key in node.agent_label_keys if key not in fields["labels"]]
                if agents != node.agent_label_keys:
                    fields = fields | {"agent_label_keys": agents}
                fields = fields | {"labels": {**node.labels, **fields["labels"]}}
            for field, value in fields.items():
                setattr(node, field, value)
            node.save(update_fields=[*fields, "updated_at"])
    return node, created


# --- out of service (operators: the admin) ---------------------------------------------------


@dataclass(frozen=True)
class OutOfService:
    node: Node
    mode: str  # "drain" or "maintenance"
    requeued: list[int]  # maintenance: tasks sent back to the queue at once
    stopping: list[int]  # maintenance: tasks their agent stops before they are queued again


def _set_cordon(node: Node, mode: str | None) -> None:
    """The scheduler's CORDON_LABEL, in one narrow UPDATE of the labels column (a beat
    merges its labels by key, so it leaves this one alone)."""
    with connection.cursor() as cursor:
        if mode is None:
            cursor.execute(
                "UPDATE nodes SET labels = labels - %s, updated_at = now() WHERE id = %s", [CORDON_LABEL, node.pk]
            )
        else:
            cursor.execute(
                "UPDATE nodes SET labels = labels || jsonb_build_object(%s::text, %s::text), updated_at = now() "
                "WHERE id = %s",
                [CORDON_LABEL, mode, node.pk],
            )
    node.refresh_from_db(fields=["labels", "updated_at"])


def drain_node(node: Node) -> OutOfService:
    """The node takes no new task; the tasks on it run to their end ("drain": the
    gentle way, as when a node changes tenant)."""
    _set_cordon(node, "drain")
    return OutOfService(node, "drain", [], [])


def start_maintenance(node: Node) -> OutOfService:
    """The node takes no new task and its tasks move elsewhere: not yet started, back to
    the queue at once; starting or running, stopped by the agent and then queued again
    (as a preemption). Sleeping, paused and ending tasks are left alone."""
    with transaction.atomic():
        _set_cordon(node, "maintenance")
        on_node = list(Task.objects.filter(node=node, status__in=ACTIVE).values_list("pk", flat=True))
        moved = requeue_tasks(on_node, why=f"node {node.pk} went into maintenance")
    return OutOfService(node, "maintenance", moved["pending"], moved["preempting"])


def return_to_service(node: Node) -> Node:
    """Drain or maintenance ends: the node takes tasks again."""
    _set_cordon(node, None)
    return node


# --- out of service (operators: the API) -----------------------------------------------------

IN_SERVICE = "in_service"
# move -> the service states it applies from ("" stands for in service: no cordon label)
SERVICE_MOVES: dict[str, tuple[str, ...]] = {
    "drain": ("",),
    "maintenance": ("", "drain"),  # a drain can be hardened into maintenance
    "return": ("drain", "maintenance"),
}


def service_state(node: Node) -> str:
    """The service state: in_service, drain or maintenance (or another value an operator gave the
    cordon label by hand: the node takes no new task all the same)."""
    return node.labels.get(CORDON_LABEL) or IN_SERVICE


@dataclass(frozen=True)
class ServiceChanged:
    node: Node
    service: str  # the state the node is in now
    requeued: list[int]
    stopping: list[int]


def change_service(node: Node, move: str, principal, *, reason: str = "") -> ServiceChanged:
    """The API's drain, maintenance and return to service: the same moves as the admin's
    actions (drain_node, start_maintenance, return_to_service), but refused with a
    conflict when the move does not apply, and audited: in the tenant's audit log when
    the node is dedicated to one, and always as a log line of `apps.nodes.services`
    (a shared node belongs to no tenant, and there is no operators' audit table yet)."""
    if move not in SERVICE_MOVES:
        raise ValueError(move)
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)  # two operators racing: one wins
        was = locked.labels.get(CORDON_LABEL) or ""
        applies = bool(was) if move == "return" else was in SERVICE_MOVES[move]
        if not applies:
            options = " or ".join((state or IN_SERVICE).replace("_", " ") for state in SERVICE_MOVES[move])
            raise Conflict(
                f"Node '{node.pk}' is {(was or IN_SERVICE).replace('_', ' ')}; {move} applies only to a node "
                f"that is {options}.",
                NodeErrorCode.SERVICE_MOVE_NOT_APPLICABLE,
            )
        requeued: list[int] = []
        stopping: list[int] = []
        if move == "drain":
            drain_node(node)
        elif move == "maintenance":
            done = start_maintenance(node)
            requeued, stopping = done.requeued, done.stopping
        else:
            return_to_service(node)
        node.refresh_from_db()
        state = service_state(node)
        details = {"from": was or IN_SERVICE, "to": state, "requeued": requeued, "stopping": stopping}
        if reason:
            details["reason"] = reason
        if node.tenant_id is not None:  # the tenant's log, and the operators'
            record_audit(node.tenant, principal, f"node.{move}", node.pk, **details)
        else:
            record_operator_audit(principal, f"node.{move}", node.pk, **details)
    return ServiceChanged(node, state, requeued, stopping)


# --- energy settings and emission factors (docs/energy.md) -----------------------------------

ENERGY_FIELDS = ("emission_factor_g_per_kwh", "cpu_tdp_w")


def set_node_energy(node: Node, changes: dict, principal) -> Node:
    """The node's own emission factor and CPU TDP (validated by the API's serializer):
    omitted fields are unchanged, None clears. A narrow UPDATE (never races a
    heartbeat's columns), recorded with what it was and what it is."""
    changes = {field: changes[field] for field in ENERGY_FIELDS if field in changes}
    if not changes:
        return node
    with transaction.atomic():
        before = Node.objects.select_for_update().filter(pk=node.pk).values(*changes).get()
        Node.objects.filter(pk=node.pk).update(**changes)
        details = {"before": before, "after": changes}
        if node.tenant_id is not None:  # the tenant's log, and the operators'
            record_audit(node.tenant, principal, "node.energy_settings", node.pk, **details)
        else:
            record_operator_audit(principal, "node.energy_settings", node.pk, **details)
    for field, value in changes.items():
        setattr(node, field, value)
    return node


def put_emission_factor(region: str, g_co2e_per_kwh: float, source: str, principal) -> tuple[EmissionFactor, bool]:
    """Set a region's factor (created or replaced), recorded in the operators' log."""
    with transaction.atomic():
        before = (
            EmissionFactor.objects.select_for_update().filter(region=region).values("g_co2e_per_kwh", "source").first()
        )
        factor, created = EmissionFactor.objects.update_or_create(
            region=region, defaults={"g_co2e_per_kwh": g_co2e_per_kwh, "source": source}
        )
        record_operator_audit(
            principal,
            "emission_factor.set",
            region,
            before=before,
            after={"g_co2e_per_kwh": g_co2e_per_kwh, "source": source},
        )
    return factor, created


def delete_emission_factor(factor: EmissionFactor, principal) -> None:
    with transaction.atomic():
        EmissionFactor.objects.filter(pk=factor.pk).delete()
        record_operator_audit(
            principal,
            "emission_factor.deleted",
            factor.region,
            before={"g_co2e_per_kwh": factor.g_co2e_per_kwh, "source": factor.source},
        )
