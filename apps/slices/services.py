"""Every state change of slices and their requests outside a task's bind and move
(those are `apps.slices.ledger`, in the scheduler's and move_tasks' transactions): the
agent's claim and reports on the slice command channel, the orphan GC and the
compensation scan (docs/slices.md).

The request's status moves by compare-and-set through `apps.core.cas` under
REQUEST_TRANSITIONS (of the agent's report and the scan's time-out, one wins). What a
report means for its slice is applied by `apply_outcome`, conditioned on the slice's
state, so applying it twice (a crash between the request's move and the slice's, then the
scan) changes nothing the second time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import transaction
from django.db.models import BooleanField, Count, Exists, F, Max, OuterRef, Q
from django.db.models.expressions import RawSQL
from psycopg.types.json import Jsonb

from apps.core import locks
from apps.core.cas import compare_and_set
from apps.core.clock import utcnow
from apps.nodes.models import Gpu, Node
from apps.slices import ledger
from apps.slices.choices import (
    HOLDING,
    LIVE,
    REQUEST_OPEN,
    REQUEST_SECONDS,
    REQUEST_TRANSITIONS,
    RequestStatus,
    SliceAction,
    SliceState,
    Tier,
)
from apps.slices.models import Slice, SliceRequest
from apps.tasks.choices import HOLDING as TASK_HOLDING
from apps.tasks.choices import TaskStatus
from apps.tasks.services import move_tasks, record_event

RS, SL = RequestStatus, SliceState

# the compensation scan's own critical section: the spec's "advisory lock 9603"
COMPENSATION_LOCK = "slices:compensation:9603"
# a card whose create or destroy reported this recently is left alone by the GC: the
# heartbeat it reads may predate the report (a new instance not yet confirmed, or one
# already destroyed still listed)
SETTLE_SECONDS = 30
# a failed (or timed-out) destroy is issued again after 60 s, 120 s, 240 s… (at most 10 min)
DESTROY_BACKOFF_SECONDS = 60
DESTROY_BACKOFF_MAX_SECONDS = 600
SLICE_FAILED = "SliceFailed"
# the nodes whose latest beat lists a MIG instance on some card (the GC reads only those)
REPORTS_MIG_INSTANCES = RawSQL(
    "jsonb_typeof(nodes.gpu_capabilities) = 'object' AND jsonb_path_exists(nodes.gpu_capabilities, %s::jsonpath)",
    ["$.*.mig_instances[0]"],
    output_field=BooleanField(),
)


class NotProcessing(Exception):
    """The request is not (any more) in the status the agent said it saw."""

    def __init__(self, request: SliceRequest):
        self.request = request
        super().__init__(f"Slice request {request.pk} is {request.status}; nothing changed.")


# --- the agent's channel ------------------------------------------------------------------


def pending_for_node(node_id: str, status: str = RS.PENDING, limit: int = 5) -> list[SliceRequest]:
    return list(SliceRequest.objects.filter(node_id=node_id, status=status).order_by("id")[:limit])


def claim(request: SliceRequest, *, now=None) -> SliceRequest:
    """pending → processing (deadline now + 120 s) by CAS; a create's slice requested →
    issued. NotProcessing when the request was not pending any more."""
    now = now or utcnow()
    with transaction.atomic():
        won = compare_and_set(
            SliceRequest._meta.db_table,
            REQUEST_TRANSITIONS,
            [request.pk],
            [RS.PENDING],
            RS.PROCESSING,
            fixed={"claimed_at": now, "deadline": now + timedelta(seconds=REQUEST_SECONDS), "updated_at": now},
        )
        request.refresh_from_db()
        if not won:
            raise NotProcessing(request)
        if request.action == SliceAction.CREATE:
            Slice.objects.filter(pk=request.slice_id, state=SL.REQUESTED).update(state=SL.ISSUED, updated_at=now)
    return request


def report(request: SliceRequest, *, status: str, result: dict, error: str = "", now=None) -> SliceRequest:
    """processing → completed / failed by CAS, with the agent's truthful result, and what
    follows for the slice (apply_outcome) in the same transaction. NotProcessing when
    the request is not processing (timed out meanwhile, or a retried report)."""
    now = now or utcnow()
    with transaction.atomic():
        won = compare_and_set(
            SliceRequest._meta.db_table,
            REQUEST_TRANSITIONS,
            [request.pk],
            [RS.PROCESSING],
            status,
            fixed={"result": Jsonb(result), "error": error, "finished_at": now, "updated_at": now},
        )
        request.refresh_from_db()
        if not won:
            raise NotProcessing(request)
        apply_outcome(request, now=now)
    return request


# --- what a finished request means for its slice ---------------------------------------------


def _task_still_served(slice_: Slice) -> bool:
    task = slice_.task
    return task is not None and task.status in TASK_HOLDING and task.node_id == slice_.node_id


def _requeue(slice_: Slice, message: str) -> None:
    """The task of a slice that could not be made goes back to the queue (its slice is
    already out of HOLDING, so move_tasks' release finds nothing more to do)."""
    if slice_.task_id is None:
        return
    moved = move_tasks(
        slice_.task_id,
        [TaskStatus.SCHEDULED],
        TaskStatus.PENDING,
        node=None,
        host_port=None,
        schedule_reason={"code": SLICE_FAILED, "message": message},
    )
    if moved:
        record_event(
            slice_.task,
            kind="requeued",
            message=f"{message}: back in the queue",
            details={"slice_id": slice_.pk},
            node_id=slice_.node_id,
        )


def _handles_of(instance: dict) -> tuple[str, dict]:
    """device_id and handles of one instance a create left on the card."""
    return instance.get("uuid", "") or "", {k: instance[k] for k in ("gi", "ci") if k in instance}


def _destroy_or_release(slice_: Slice, now) -> None:
    """A slice whose task is gone: destroyed on the card, or released at once when the
    tier leaves nothing there (software, MPS)."""
    if slice_.tier in ledger.NOTHING_TO_DESTROY:
        Slice.objects.filter(pk=slice_.pk).update(state=SL.RELEASED, released_at=now, updated_at=now)
        return
    ledger.issue([slice_], SliceAction.DESTROY)


def apply_outcome(request: SliceRequest, *, now=None) -> bool:
    """What the finished `request` means for its slice, conditioned on the slice's state
    (the caller holds the transaction). True when it changed something; applying the
    same outcome again changes nothing."""
    now = now or utcnow()
    slice_ = Slice.objects.select_for_update(of=("self",)).select_related("task").get(pk=request.slice_id)
    result = request.result or {}
    if request.action == SliceAction.CREATE:
        if slice_.state not in (SL.ISSUED, SL.RELEASING):
            return False
        # a later request of the slice is the one that counts (a destroy issued since)
        if slice_.requests.filter(pk__gt=request.pk).exists():
            return False
        if request.status == RS.COMPLETED:
            return _create_completed(slice_, request, result, now)
        return _create_failed(slice_, request, result, now)
    if slice_.state not in (SL.RELEASING, SL.ORPHANED):
        return False
    if slice_.requests.filter(pk__gt=request.pk).exists():
        return False
    if request.status == RS.COMPLETED:
        Slice.objects.filter(pk=slice_.pk).update(state=SL.RELEASED, released_at=now, error="", updated_at=now)
        return True
    # a failed or timed-out destroy: the slice stays, its error kept, with what is left on
    # the card when the agent says (a partial destroy); the scan issues it again
    error = request.error or ("timed out" if request.status == RS.TIMED_OUT else "the destroy failed")
    changes = {"error": error, "updated_at": now}
    if request.status == RS.FAILED and isinstance(result.get("handles"), dict) and result["handles"]:
        changes["handles"] = result["handles"]
    Slice.objects.filter(pk=slice_.pk).update(**changes)
    return True


def _create_completed(slice_: Slice, request: SliceRequest, result: dict, now) -> bool:
    created = list(result.get("created") or [])
    device_id = result.get("device_id") or (created[0].get("uuid") if created else "") or slice_.device_id
    handles = result.get("handles") or (_handles_of(created[0])[1] if created else {}) or slice_.handles
    if slice_.tier == Tier.MIG and not device_id:
        # no MIG device to hand the task: never confirmed (no limit, no start)
        return _create_failed(slice_, request, result, now, why="the agent reported no MIG device for it")
    device_id = device_id or slice_.gpu_uuid  # MPS / HAMi: the card, unless the vendor named a device
    slice_.device_id, slice_.handles = device_id, handles
    if slice_.state == SL.ISSUED and _task_still_served(slice_):
        Slice.objects.filter(pk=slice_.pk).update(
            state=SL.CONFIRMED, device_id=device_id, handles=handles, confirmed_at=now, error="", updated_at=now
        )
        return True
    # the task ended while the create was in flight: undo it at once
    Slice.objects.filter(pk=slice_.pk).update(
        state=SL.RELEASING, device_id=device_id, handles=handles, confirmed_at=now, updated_at=now
    )
    _destroy_or_release(slice_, now)
    return True


def _create_failed(slice_: Slice, request: SliceRequest, result: dict, now, *, why: str = "") -> bool:
    created = list(result.get("created") or [])
    if why:
        message = f"the slice was not confirmed: {why}"
    elif request.status == RS.TIMED_OUT:
        message = f"the agent did not report the slice's create within {REQUEST_SECONDS} s"
    else:
        message = f"the agent could not make the slice: {request.error or 'no reason given'}"
    serving = slice_.state == SL.ISSUED
    if created:
        # each instance it made is destroyed by a request of its own (one instance per
        # slice, as the agent's destroy expects): the slice keeps the first, any others
        # get orphaned rows of their own
        device_id, handles = _handles_of(created[0])
        Slice.objects.filter(pk=slice_.pk).update(
            state=SL.ORPHANED, device_id=device_id, handles=handles, error=message, updated_at=now
        )
        slice_.device_id, slice_.handles, slice_.state = device_id, handles, SL.ORPHANED
        extra = [_orphan_row(slice_, instance, message) for instance in created[1:]]
        ledger.issue([slice_, *extra], SliceAction.DESTROY)
    else:
        Slice.objects.filter(pk=slice_.pk).update(state=SL.FAILED, error=message, updated_at=now)
    if serving:
        _requeue(slice_, message)
    return True


def _orphan_row(like: Slice, instance: dict, error: str) -> Slice:
    """An orphaned slice for one more instance a partial create left on `like`'s card."""
    device_id, handles = _handles_of(instance)
    return Slice.objects.create(
        node_id=like.node_id,
        gpu_index=like.gpu_index,
        gpu_uuid=like.gpu_uuid,
        tenant_id=like.tenant_id,
        tier=like.tier,
        memory_mb=_profile_memory_mb(instance.get("profile", "")) or like.memory_mb,
        compute_percent=like.compute_percent,
        profile=instance.get("profile", "") or like.profile,
        state=SL.ORPHANED,
        device_id=device_id,
        handles=handles,
        reason={"why": f"left on the card by the failed create of slice {like.pk}"},
        error=error,
    )


# --- the orphan GC -------------------------------------------------------------------------


@dataclass
class GcReport:
    released_for_tasks: int = 0
    released_taskless: int = 0
    orphans: list[int] = field(default_factory=list)
    skipped_cards: list[tuple[str, int]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "released_for_tasks": self.released_for_tasks,
            "released_taskless": self.released_taskless,
            "orphans": self.orphans,
            "skipped_cards": [f"{node}/{index}" for node, index in self.skipped_cards],
        }


def _profile_memory_mb(profile: str) -> int:
    match = re.search(r"(\d+)gb", profile or "")
    return int(match.group(1)) * 1024 if match else 0


def _owned(slices) -> tuple[set[str], set[int]]:
    """The MIG UUIDs and GPU instance ids the slices on one card claim. A slice is one GPU
    instance with its compute instance (`-cgi PROFILE -C`), and GPU instance ids are
    unique on a card, so the GI id names what a slice owns even before its compute
    instance or UUID exists (a partial create, a listing without UUIDs)."""
    uuids, gis = set(), set()
    for slice_ in slices:
        handles = slice_.handles if isinstance(slice_.handles, dict) else {}
        for item in [handles, *(i for i in handles.get("instances", []) if isinstance(i, dict))]:
            if item.get("uuid"):
                uuids.add(item["uuid"])
            if isinstance(item.get("gi"), int):
                gis.add(item["gi"])
        if slice_.device_id:
            uuids.add(slice_.device_id)
    return uuids, gis


def gc(*, now=None) -> GcReport:
    """The orphan GC (every 60 s, guarded): HOLDING slices whose task ended, left its
    node or is gone are given back; MIG instances a node reports that no LIVE slice owns
    get an orphaned row and a destroy request, never on a card with a create in flight."""
    now = now or utcnow()
    out = GcReport()
    with transaction.atomic():
        holding = Slice.objects.filter(state__in=HOLDING)
        ended = set(
            holding.filter(task__isnull=False)
            .exclude(Q(task__status__in=TASK_HOLDING) & Q(task__node_id=F("node_id")))
            .values_list("task_id", flat=True)
        )
        if ended:
            out.released_for_tasks = ledger.release_for_tasks(sorted(ended), now)
        for slice_ in Slice.objects.select_for_update().filter(state__in=HOLDING, task__isnull=True).order_by("pk"):
            out.released_taskless += _release_taskless(slice_, now)
        for node in Node.objects.filter(REPORTS_MIG_INSTANCES).order_by("pk"):
            _gc_node(node, now, out)
    return out


def _release_taskless(slice_: Slice, now) -> int:
    """A HOLDING slice whose task was deleted (task null): as release_for_tasks would."""
    if slice_.state == SL.REQUESTED:
        SliceRequest.objects.filter(slice=slice_, status=RS.PENDING).update(
            status=RS.FAILED, error="withdrawn: the task is gone", finished_at=now, updated_at=now
        )
        Slice.objects.filter(pk=slice_.pk).update(state=SL.FAILED, error="the task is gone", updated_at=now)
    elif slice_.state == SL.ISSUED:  # the create reports first; apply_outcome then undoes it
        Slice.objects.filter(pk=slice_.pk).update(state=SL.RELEASING, updated_at=now)
    else:
        Slice.objects.filter(pk=slice_.pk).update(state=SL.RELEASING, updated_at=now)
        _destroy_or_release(slice_, now)
    return 1


def _card_busy(node_id: str, index: int, now) -> bool:
    """A change in flight on the card: a create processing, or a create or destroy
    completed within the settle time (the beat may predate it)."""
    return SliceRequest.objects.filter(
        Q(status=RS.PROCESSING, action=SliceAction.CREATE)
        | Q(status=RS.COMPLETED, finished_at__gte=now - timedelta(seconds=SETTLE_SECONDS)),
        node_id=node_id,
        slice__gpu_index=index,
    ).exists()


def _gc_node(node: Node, now, out: GcReport) -> None:
    caps = node.gpu_capabilities or {}
    for key, card in sorted(caps.items()):
        instances = card.get("mig_instances") if isinstance(card, dict) else None
        if not instances or not str(key).isdigit():
            continue  # absent (not known) or none there
        index = int(key)
        live = list(Slice.objects.select_for_update().filter(node=node, gpu_index=index, state__in=LIVE))
        uuids, gis = _owned(live)
        unowned = [
            i
            for i in instances
            if isinstance(i, dict)
            and isinstance(i.get("gi"), int)
            and not (i.get("uuid") and i["uuid"] in uuids)
            and i["gi"] not in gis
        ]
        if not unowned:
            continue
        if _card_busy(node.pk, index, now):
            out.skipped_cards.append((node.pk, index))
            continue
        gpu_uuid = Gpu.objects.filter(node=node, index=index).values_list("uuid", flat=True).first() or ""
        for instance in unowned:
            orphan = Slice.objects.create(
                node=node,
                gpu_index=index,
                gpu_uuid=gpu_uuid,
                tier=Tier.MIG,
                memory_mb=_profile_memory_mb(instance.get("profile", "")),
                profile=instance.get("profile", "") or "",
                state=SL.ORPHANED,
                device_id=instance.get("uuid", "") or "",
                handles={k: instance[k] for k in ("gi", "ci") if k in instance},
                reason={"why": "a MIG instance the node reports that no slice owns"},
                error="found on the card with no slice owning it",
            )
            ledger.issue([orphan], SliceAction.DESTROY)
            out.orphans.append(orphan.pk)


# --- the compensation scan -------------------------------------------------------------------


@dataclass
class ScanReport:
    busy: bool = False
    timed_out: list[int] = field(default_factory=list)
    reapplied: list[int] = field(default_factory=list)
    destroys: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "busy": self.busy,
            "timed_out": self.timed_out,
            "reapplied": self.reapplied,
            "destroys": self.destroys,
            "released": self.released,
        }


def time_out(now=None) -> list[int]:
    """Requests processing past their deadline → timed_out, with what follows."""
    now = now or utcnow()
    late = list(
        SliceRequest.objects.filter(status=RS.PROCESSING, deadline__lt=now).order_by("pk").values_list("pk", flat=True)
    )
    won = compare_and_set(
        SliceRequest._meta.db_table,
        REQUEST_TRANSITIONS,
        late,
        [RS.PROCESSING],
        RS.TIMED_OUT,
        fixed={"error": f"not reported within {REQUEST_SECONDS} s", "finished_at": now, "updated_at": now},
    )
    ids = [row[0] for row in won]
    for request in SliceRequest.objects.filter(pk__in=ids).order_by("pk"):
        apply_outcome(request, now=now)
    return ids


def _destroy_due(failures: int, last_finished, now) -> bool:
    if not failures or last_finished is None:
        return True
    wait = min(DESTROY_BACKOFF_MAX_SECONDS, DESTROY_BACKOFF_SECONDS * 2 ** (failures - 1))
    return now - last_finished >= timedelta(seconds=wait)


def compensate(*, now=None) -> ScanReport:
    """The compensation scan (every 60 s, under its own advisory lock): finishes what a
    crash or a silent agent left half way. Running it again changes nothing more."""
    now = now or utcnow()
    out = ScanReport()
    with transaction.atomic():
        if not locks.try_xact_lock(COMPENSATION_LOCK):
            out.busy = True
            return out
        out.timed_out = time_out(now)
        # a finished report whose slice did not move (a crash between the two writes)
        waiting = Slice.objects.filter(state__in=(SL.ISSUED, SL.RELEASING, SL.ORPHANED)).exclude(
            requests__status__in=REQUEST_OPEN
        )
        for slice_id in waiting.order_by("pk").values_list("pk", flat=True).distinct():
            latest = SliceRequest.objects.filter(slice_id=slice_id).order_by("-pk").first()
            if latest is None or latest.status not in (RS.COMPLETED, RS.FAILED, RS.TIMED_OUT):
                continue
            if latest.action == SliceAction.DESTROY and latest.status != RS.COMPLETED:
                continue  # a failed destroy: issued again below, after the back-off
            if apply_outcome(latest, now=now):
                out.reapplied.append(latest.pk)
        # releasing / orphaned slices with nothing open and no completed destroy
        destroyed = SliceRequest.objects.filter(
            slice_id=OuterRef("pk"), action=SliceAction.DESTROY, status=RS.COMPLETED
        )
        stuck = (
            Slice.objects.select_for_update()
            .filter(state__in=(SL.RELEASING, SL.ORPHANED))
            .exclude(requests__status__in=REQUEST_OPEN)
            .exclude(Exists(destroyed))
            .order_by("pk")
        )
        for slice_ in stuck:
            if slice_.tier in ledger.NOTHING_TO_DESTROY:
                Slice.objects.filter(pk=slice_.pk).update(state=SL.RELEASED, released_at=now, updated_at=now)
                out.released.append(slice_.pk)
                continue
            failed = slice_.requests.filter(action=SliceAction.DESTROY, status__in=(RS.FAILED, RS.TIMED_OUT)).aggregate(
                n=Count("pk"), last=Max("finished_at")
            )
            if not _destroy_due(failed["n"], failed["last"], now):
                continue
            if ledger.issue([slice_], SliceAction.DESTROY):
                out.destroys.append(slice_.pk)
    return out
