"""The slices' writes that ride in other apps' transactions: a task's slice carved at
bind (the scheduler's `bind_all`) and given back when the task leaves its node
(`apps.tasks.services.move_tasks`), plus the one way a request for the agent is issued.

Like `apps.scheduler.ledger` it imports only models, choices and the pure planning rules
(layer 6, beside tasks), so the scheduler above and tasks below both call it without a
cycle. Everything the agent's reports and the periodic scans do is in
`apps.slices.services`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from django.db import connection

from apps.core.db import insert_rows
from apps.slices.choices import (
    LIVE,
    REQUEST_OPEN,
    VENDOR_OF_TIER,
    RequestStatus,
    SliceAction,
    SliceState,
    Tier,
)
from apps.slices.models import Slice, SliceRequest
from apps.slices.planning import Refusal, SlicePlan, plan_slice

SL = SliceState
# tiers with nothing to make or unmake on the card: confirmed at bind, released at once
NO_HARDWARE = (Tier.SOFTWARE,)
# tiers whose limits live only in the task's own process (MPS per-client limits): made
# by the agent's create (the daemon is checked alive), nothing to destroy afterwards
NOTHING_TO_DESTROY = (Tier.SOFTWARE, Tier.MPS)


def request_params(slice_: Slice) -> dict:
    """What the agent needs to act on a slice, and re-validates before it runs."""
    return {
        "gpu_index": slice_.gpu_index,
        "gpu_uuid": slice_.gpu_uuid,
        "profile": slice_.profile,
        "memory_mb": slice_.memory_mb,
        "compute_percent": slice_.compute_percent,
        "device_id": slice_.device_id,
        "handles": slice_.handles,
    }


def issue(slices: Sequence[Slice], action: str) -> list[SliceRequest]:
    """One request per slice for the agent of its node (the caller holds the
    transaction). A slice that already has an open request gets none: an intent is never
    issued twice (the partial unique index `slice_request_open_once` says so too)."""
    if not slices:
        return []
    busy = set(
        SliceRequest.objects.filter(slice__in=[s.pk for s in slices], status__in=REQUEST_OPEN).values_list(
            "slice_id", flat=True
        )
    )
    rows = [
        SliceRequest(
            node_id=s.node_id,
            slice=s,
            action=action,
            vendor=VENDOR_OF_TIER[s.tier],
            params=request_params(s),
        )
        for s in slices
        if s.pk not in busy and s.tier in VENDOR_OF_TIER
    ]
    return SliceRequest.objects.bulk_create(rows)


@dataclass(frozen=True)
class CarveAsk:
    """A memory-only decision bind is about to make: the task's share of one card."""

    task_id: int
    tenant_id: int
    node_id: str
    gpu_index: int
    memory_mb: int  # what the task asked for (gpu_memory_mb)


@dataclass(frozen=True)
class Carve:
    """A planned slice for a decision (written by `carve` once the task won its CAS)."""

    ask: CarveAsk
    gpu_uuid: str
    plan: SlicePlan


# The asked cards with what planning needs, in one statement: the card (vendor, model,
# uuid, total), its node's tier facts (container, the card's own capabilities) and the
# LIVE slices on it, as [[profile, memory MB], ...].
CARDS_TO_CARVE = """
    SELECT g.node_id, g.index, g.vendor, g.model, g.uuid, g.memory_total_mb, n.is_container,
           CASE WHEN jsonb_typeof(n.gpu_capabilities) = 'object' THEN n.gpu_capabilities -> (g.index::text) END,
           coalesce((
               SELECT json_agg(json_build_array(s.profile, s.memory_mb)) FROM slices s
               WHERE s.node_id = g.node_id AND s.gpu_index = g.index AND s.state = ANY(%s)
           ), '[]')
    FROM gpus g JOIN nodes n ON n.id = g.node_id
    JOIN unnest(%s::text[], %s::int[]) AS asked(node_id, index) ON asked.node_id = g.node_id AND asked.index = g.index
"""


def plan_carves(asks: Sequence[CarveAsk]) -> dict[int, Carve | Refusal]:
    """Each ask's slice, planned against the cards as they are now (their node's tier
    facts, the card's model, the LIVE slices already on it), in order: a MIG profile
    taken by an earlier ask of the same batch counts for the later ones. The caller
    holds the nodes' row locks (bind), so no other binder carves the same cards
    meanwhile. One query, whatever the number of asks; none without asks."""
    if not asks:
        return {}
    wanted = sorted({(ask.node_id, ask.gpu_index) for ask in asks})
    with connection.cursor() as cursor:
        cursor.execute(CARDS_TO_CARVE, [list(LIVE), [n for n, _ in wanted], [i for _, i in wanted]])
        rows = cursor.fetchall()
    cards = {}
    live: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for node_id, index, vendor, model, uuid, total, is_container, capability, slices in rows:
        cards[(node_id, index)] = (vendor, model, uuid, total, is_container, _json(capability))
        live[(node_id, index)] = [(profile, memory) for profile, memory in _json(slices)]
    planned: dict[int, Carve | Refusal] = {}
    for ask in asks:
        where = (ask.node_id, ask.gpu_index)
        card = cards.get(where)
        if card is None:
            planned[ask.task_id] = Refusal("SliceUnplannable", f"card {ask.gpu_index} of {ask.node_id} is gone")
            continue
        vendor, model, uuid, total, is_container, capability = card
        plan = plan_slice(
            vendor=vendor,
            model_name=model,
            memory_total_mb=total,
            capability=capability,
            is_container=is_container,
            index=ask.gpu_index,
            memory_mb=ask.memory_mb,
            live=live[where],
        )
        if isinstance(plan, SlicePlan):
            live[where].append((plan.profile, plan.memory_mb))
            planned[ask.task_id] = Carve(ask, uuid, plan)
        else:
            planned[ask.task_id] = plan
    return planned


def _json(value):
    """Django's raw cursor hands json over as text (jsonb as well)."""
    return json.loads(value) if isinstance(value, (str, bytes)) else value


def carve(carves: Sequence[Carve], now) -> list[Slice]:
    """The bound tasks' slices, in bind's transaction: MIG, MPS and HAMi slices are
    `requested` with a create request for the agent; a software slice has nothing to
    make on the card and is born `confirmed` (device_id: the card's uuid)."""
    if not carves:
        return []
    rows = []
    for planned in carves:
        ask, plan = planned.ask, planned.plan
        software = plan.tier in NO_HARDWARE
        rows.append(
            Slice(
                node_id=ask.node_id,
                gpu_index=ask.gpu_index,
                gpu_uuid=planned.gpu_uuid,
                tenant_id=ask.tenant_id,
                task_id=ask.task_id,
                tier=plan.tier,
                memory_mb=plan.memory_mb,
                compute_percent=plan.compute_percent,
                profile=plan.profile,
                state=SL.CONFIRMED if software else SL.REQUESTED,
                device_id=planned.gpu_uuid if software else "",
                reason=plan.reason,
                confirmed_at=now if software else None,
            )
        )
    slices = insert_rows(rows)
    issue([s for s in slices if s.tier not in NO_HARDWARE], SliceAction.CREATE)
    return slices


def release_for_tasks(task_ids: Iterable[int], now) -> int:
    """The slices of tasks that left their node (ended, or back to the queue), in the
    move's transaction. Each by its own state, so a crash half way leaves rows the
    compensation scan finishes (apps.slices.services.compensate):

    - software and MPS: released (nothing on the card outlives the task's process);
    - requested (the agent has not claimed the create): failed, its create withdrawn;
    - issued (a create in flight): releasing; the destroy is issued when the create
      reports what it made;
    - confirmed MIG / HAMi: releasing, with a destroy request.

    Returns how many slices changed."""
    ids = list(task_ids)
    if not ids:
        return 0
    live = list(
        Slice.objects.select_for_update()
        .filter(task_id__in=ids, state__in=(SL.REQUESTED, SL.ISSUED, SL.CONFIRMED))
        .order_by("pk")
    )
    if not live:
        return 0
    released = [s.pk for s in live if s.tier in NOTHING_TO_DESTROY and s.state != SL.ISSUED]
    withdrawn = [s.pk for s in live if s.state == SL.REQUESTED and s.pk not in released]
    in_flight = [s.pk for s in live if s.state == SL.ISSUED]
    to_destroy = [s for s in live if s.state == SL.CONFIRMED and s.tier not in NOTHING_TO_DESTROY]
    if released:
        Slice.objects.filter(pk__in=released).update(state=SL.RELEASED, released_at=now, updated_at=now)
    if withdrawn:
        SliceRequest.objects.filter(slice__in=withdrawn, status=RequestStatus.PENDING).update(
            status=RequestStatus.FAILED,
            error="withdrawn: the task left its node first",
            finished_at=now,
            updated_at=now,
        )
        Slice.objects.filter(pk__in=withdrawn).update(
            state=SL.FAILED, error="the task left its node before its slice was made", updated_at=now
        )
    if in_flight:
        Slice.objects.filter(pk__in=in_flight).update(state=SL.RELEASING, updated_at=now)
    if to_destroy:
        Slice.objects.filter(pk__in=[s.pk for s in to_destroy]).update(state=SL.RELEASING, updated_at=now)
        issue(to_destroy, SliceAction.DESTROY)
    return len(live)
