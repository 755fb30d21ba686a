"""The slices' writes that ride in other apps' transactions: a task's slice carved at
bind (the scheduler's `bind_all`) and given back when the task leaves its node
(`apps.tasks.services.move_tasks`), plus the one way a request for the agent is issued.

Like `apps.scheduler.ledger` it imports only models and choices (layer 6, beside tasks),
so the scheduler above and tasks below both call it without a cycle. Everything the
agent's reports and the periodic scans do is in `apps.slices.services`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from apps.slices.choices import (
    REQUEST_OPEN,
    VENDOR_OF_TIER,
    RequestStatus,
    SliceAction,
    SliceState,
    Tier,
)
from apps.slices.models import Slice, SliceRequest

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
