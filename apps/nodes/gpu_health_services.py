"""Cordon and uncordon of single cards (docs/gpu-health.md#cordon-and-recovery).

The heartbeat's health step cordons an unhealthy card by itself (apps.nodes.health).
Here: an operator cordons or uncordons a card (the API and the admin), and the clean
period uncordons the cards the health judgement cordoned once their latest bad evidence
is old enough and they kept reporting (`recover_clean_cards`, a periodic job). Every
uncordon recovers the card's GPU_UNHEALTHY alert. A cordon never touches the tasks
already running on the card.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from rest_framework.exceptions import NotFound

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertState
from apps.alerts.models import Alert
from apps.confidential.services import record_audit
from apps.core.audit import actor_name, record_operator_audit
from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.nodes import liveness
from apps.nodes.choices import CordonSource
from apps.nodes.error_codes import NodeErrorCode
from apps.nodes.lock_order import lock_card
from apps.nodes.models import Gpu, Node

CLEARED = {"cordoned_at": None, "cordon_source": "", "cordon_reason": "", "cordon_evidence": {}}


def _locked_card(node: Node, index: int) -> Gpu:
    gpu = lock_card(node.pk, index)
    if gpu is None:
        raise NotFound(f"Node '{node.pk}' has no GPU {index}.")
    return gpu


def _audit(node: Node, principal, action: str, index: int, **details) -> None:
    """In the tenant's log when the node is dedicated to one (and the operators'), else
    in the operators' log, as the node's service moves are."""
    target = f"{node.pk}/gpu/{index}"
    if node.tenant_id is not None:
        record_audit(node.tenant, principal, action, target, **details)
    else:
        record_operator_audit(principal, action, target, **details)


def _recover(keys: list[str], now: datetime) -> int:
    return Alert.objects.filter(key__in=keys, state=AlertState.ACTIVE).update(
        state=AlertState.RECOVERED, ended_at=now, updated_at=now
    )


def cordon_card(node: Node, index: int, reason: str, principal) -> Gpu:
    """An operator takes one card out of placement (the tasks on it run on). Refused
    (409) when the card is already cordoned, whoever cordoned it."""
    now = utcnow()
    with transaction.atomic():
        gpu = _locked_card(node, index)
        if gpu.cordoned_at is not None:
            raise Conflict(
                f"GPU {index} of node '{node.pk}' is already cordoned ({gpu.cordon_source}: {gpu.cordon_reason}).",
                NodeErrorCode.GPU_ALREADY_CORDONED,
            )
        gpu.cordoned_at, gpu.cordon_source, gpu.cordon_reason = now, CordonSource.OPERATOR, reason
        gpu.cordon_evidence = {"by": actor_name(principal), "at": now.isoformat().replace("+00:00", "Z")}
        gpu.save(update_fields=["cordoned_at", "cordon_source", "cordon_reason", "cordon_evidence", "updated_at"])
        _audit(node, principal, "gpu.cordon", index, reason=reason)
    return gpu


def uncordon_card(node: Node, index: int, principal, *, note: str = "") -> Gpu:
    """An operator puts the card back into placement, whoever cordoned it; its
    GPU_UNHEALTHY alert recovers. Refused (409) when the card is not cordoned. The card's
    health history (last_bad_at, the samples) stays: a new bad reading cordons it again."""
    now = utcnow()
    with transaction.atomic():
        gpu = _locked_card(node, index)
        if gpu.cordoned_at is None:
            raise Conflict(f"GPU {index} of node '{node.pk}' is not cordoned.", NodeErrorCode.GPU_NOT_CORDONED)
        was = {"source": gpu.cordon_source, "reason": gpu.cordon_reason}
        for field, value in CLEARED.items():
            setattr(gpu, field, value)
        gpu.save(update_fields=[*CLEARED, "updated_at"])
        recovered = _recover([alert_keys.gpu_unhealthy(node.pk, index)], now)
        details = {"was": was, "alert_recovered": bool(recovered)}
        if note:
            details["note"] = note
        _audit(node, principal, "gpu.uncordon", index, **details)
    return gpu


@dataclass(frozen=True)
class CleanRecovery:
    uncordoned: list[tuple[str, int]]  # (node id, index)
    alerts_recovered: int


# Cards across the fleet: taken in the beat's order (node id, index), skipping a card a
# beat holds now; it is judged again on the next run (docs/architecture.md#lock-order).
RECOVER_CLEAN = """
    WITH due AS (
        SELECT g.id FROM gpus AS g JOIN nodes AS n ON n.id = g.node_id
        WHERE g.cordoned_at IS NOT NULL AND g.cordon_source = %(health)s
          AND g.last_bad_at < %(clean_since)s
          -- kept reporting: present, with a health reading, on a node beating now, and the
          -- latest reading not itself a failure state
          AND g.lost_at IS NULL AND g.health_at IS NOT NULL AND g.health <> '{}'::jsonb
          AND COALESCE((g.health ->> 'remapped_rows_failure')::boolean, false) = false
          AND n.last_heartbeat_at >= %(alive_since)s
        ORDER BY g.node_id, g.index FOR NO KEY UPDATE OF g SKIP LOCKED
    )
    UPDATE gpus AS g SET cordoned_at = NULL, cordon_source = '', cordon_reason = '', cordon_evidence = '{}'::jsonb,
                         updated_at = %(now)s
    FROM due WHERE g.id = due.id
    RETURNING g.node_id, g.index
"""


def recover_clean_cards(now: datetime | None = None) -> CleanRecovery:
    """The clean period (HETEROFLOW_GPU_HEALTH_CLEAN_HOURS; 0: operators only): uncordon
    the cards the health judgement cordoned whose latest bad evidence is older than the
    period and that kept reporting, recover their alerts, and record each in the
    operators' audit log as the system's. An operator's cordon is never lifted here."""
    hours = settings.HETEROFLOW_GPU_HEALTH_CLEAN_HOURS
    if not hours:
        return CleanRecovery([], 0)
    now = now or utcnow()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            RECOVER_CLEAN,
            {
                "now": now,
                "health": CordonSource.HEALTH.value,
                "clean_since": now - timedelta(hours=hours),
                "alive_since": now - liveness.give_up_after(),
            },
        )
        cards = [(node_id, index) for node_id, index in cursor.fetchall()]
        recovered = _recover([alert_keys.gpu_unhealthy(node_id, index) for node_id, index in cards], now)
        for node_id, index in cards:
            record_operator_audit(None, "gpu.uncordon", f"{node_id}/gpu/{index}", clean_hours=hours)
    return CleanRecovery(sorted(cards), recovered)
