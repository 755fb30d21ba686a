"""The image channel's state changes (docs/images.md): operators' pull and check requests
for a live node, the agent's claim, progress and final report, and the janitor.

A request moves pending → processing → completed / failed, every move a compare-and-set
(apps.core.cas, IMAGE_REQUEST_TRANSITIONS), so a report that lost (the janitor closed the
request, a second claim) changes nothing and learns it. A pull is judged by its progress,
never by its total time: stalled after IMAGE_STALLED_SECONDS without a progress report,
over budget only after IMAGE_PULL_BUDGET_SECONDS in all."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce

from apps.core.cas import transition
from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.nodes import liveness
from apps.nodes.choices import (
    ALIVE,
    IMAGE_CHECK_MAX_REFERENCES,
    IMAGE_PULL_BUDGET_SECONDS,
    IMAGE_REQUEST_OPEN,
    IMAGE_REQUEST_TRANSITIONS,
    IMAGE_STALLED_SECONDS,
    ImageAction,
    ImageRequestStatus,
)
from apps.nodes.error_codes import NodeErrorCode
from apps.nodes.images_protocol import answers
from apps.nodes.models import ImageRequest, Node, WatchedImage

IRS = ImageRequestStatus
AGENT_LIST_MAX = 5  # the requests one poll of the agent gets, oldest first
ERROR_MAX = 4000
PRUNE_BATCH = 1000
PRUNE_BATCHES_PER_RUN = 20
STALLED = "stalled: no progress for 10 minutes"
OVER_BUDGET = "over budget: not finished within 2 hours"
NODE_OFFLINE = "node offline: the node went offline before its agent took the request"
PULLED_BUT_NOT_THERE = "pulled but not there"


# --- operators --------------------------------------------------------------------------------


def node_alive(node: Node, now: datetime | None = None) -> bool:
    """The node answers: its status says so and its silence (liveness) agrees, so a node
    the health checker has not caught up with yet is not taken for alive."""
    now = now or utcnow()
    return node.status in ALIVE and node.status_at(now) in ALIVE


def check_alive(node: Node, now: datetime) -> None:
    if not node_alive(node, now):
        heard = node.last_heartbeat_at.isoformat() if node.last_heartbeat_at else "never"
        raise Conflict(
            f"Node '{node.pk}' is not online (status {node.status_at(now)}, last heartbeat {heard}): "
            "its agent cannot take an image request, so none was made.",
            NodeErrorCode.NODE_OFFLINE,
        )


def request_pull(node: Node, reference: str, *, requested_by: str = "", now: datetime | None = None) -> ImageRequest:
    """A pull of one reference (validated by the caller). A pull of the same reference
    still open on the node is answered instead of a second one: deploying twice is safe."""
    now = now or utcnow()
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)  # one open pull per reference
        check_alive(locked, now)
        open_pull = (
            ImageRequest.objects.filter(
                node=locked, action=ImageAction.PULL, status__in=IMAGE_REQUEST_OPEN, references=[reference]
            )
            .order_by("id")
            .first()
        )
        if open_pull is not None:
            return open_pull
        return _create(locked, ImageAction.PULL, [reference], requested_by, now)


def request_check(
    node: Node, references: list[str], *, requested_by: str = "", now: datetime | None = None
) -> ImageRequest:
    """A check of up to IMAGE_CHECK_MAX_REFERENCES references (validated by the caller)."""
    now = now or utcnow()
    if not 1 <= len(references) <= IMAGE_CHECK_MAX_REFERENCES:
        raise ValueError(f"a check asks for 1 to {IMAGE_CHECK_MAX_REFERENCES} references")
    with transaction.atomic():
        check_alive(node, now)
        return _create(node, ImageAction.CHECK, list(dict.fromkeys(references)), requested_by, now)


def _create(node: Node, action: str, references: list[str], requested_by: str, now: datetime) -> ImageRequest:
    return ImageRequest.objects.create(
        node=node,
        action=action,
        references=references,
        requested_by=requested_by[:200],
        deadline=now + timedelta(seconds=IMAGE_PULL_BUDGET_SECONDS),
    )


def watched_images(node: Node):
    """The images this node should have: its GPU vendor's and every vendor's."""
    return WatchedImage.objects.filter(Q(vendor="") | Q(vendor=node.gpu_type) if node.gpu_type else Q(vendor=""))


def watched_by_vendor() -> dict[str, list[WatchedImage]]:
    """Every watched image by vendor ('' for every vendor), in one query: for a page of
    nodes (watched_images' rule, applied as watched_for)."""
    grouped: dict[str, list[WatchedImage]] = {}
    for watched in WatchedImage.objects.all():
        grouped.setdefault(watched.vendor, []).append(watched)
    return grouped


def watched_for(node: Node, grouped: dict[str, list[WatchedImage]]) -> list[WatchedImage]:
    rows = grouped.get("", []) + (grouped.get(node.gpu_type, []) if node.gpu_type else [])
    return sorted(rows, key=lambda w: (w.vendor, w.kind, w.reference))


# --- the agent --------------------------------------------------------------------------------


def agent_requests(node_id: str, status: str) -> list[ImageRequest]:
    return list(ImageRequest.objects.filter(node_id=node_id, status=status).order_by("id")[:AGENT_LIST_MAX])


@dataclass(frozen=True)
class Report:
    """An agent's report, validated: claim (pending → processing), progress (processing
    → processing, with `progress`) or final (processing → completed / failed)."""

    from_status: str
    status: str
    progress: dict | None = None
    result: dict | None = None
    error: str = ""


def apply_report(request: ImageRequest, report: Report, now: datetime | None = None) -> bool:
    """Apply the report as a compare-and-set from the status it saw. False when it lost
    (the request is no longer in that status): nothing changed. A final report is judged
    first (judge_final): a completed one that does not prove its work is stored failed."""
    now = now or utcnow()
    with transaction.atomic():
        if report.from_status == IRS.PENDING and report.status == IRS.PROCESSING:
            won = transition(
                ImageRequest, IMAGE_REQUEST_TRANSITIONS, request.pk, [IRS.PENDING], IRS.PROCESSING, claimed_at=now
            )
            return bool(won)
        if report.from_status == IRS.PROCESSING and report.status == IRS.PROCESSING:
            # a progress report changes no status: the guard is the same (still processing)
            return bool(
                ImageRequest.objects.filter(pk=request.pk, status=IRS.PROCESSING).update(
                    progress=report.progress or {}, progress_at=now, updated_at=now
                )
            )
        status, result, error = judge_final(request, report)
        won = transition(
            ImageRequest,
            IMAGE_REQUEST_TRANSITIONS,
            request.pk,
            [report.from_status],
            status,
            result=result,
            error=error[:ERROR_MAX],
            finished_at=now,
        )
        return bool(won)


def judge_final(request: ImageRequest, report: Report) -> tuple[str, dict, str]:
    """(status, result, error) to store for a final report. Each result item's reference
    is written as asked (an old agent answers a bare "repo/x" as "repo/x:latest"; that is
    accepted and stored under "repo/x"). A completed pull must carry the pulled
    reference's check with present true, a completed check an item for every reference
    it asked; otherwise the request is failed: a pull that says it is done but whose
    image is not there is not a success."""
    result = _as_asked(request.references, report.result or {})
    if report.status == IRS.FAILED:
        return IRS.FAILED, result, report.error or "failed (the agent gave no reason)"
    items = {item["reference"]: item for item in result.get("images", [])}
    if request.action == ImageAction.PULL:
        reference = request.references[0]
        item = items.get(reference)
        if item is None or not proves_pull(reference, item):
            why = "absent from its check" if item is not None else "not in the report's check result"
            return (
                IRS.FAILED,
                result,
                f"{PULLED_BUT_NOT_THERE}: the agent reported the pull done, but {reference} is {why}",
            )
        return IRS.COMPLETED, result, report.error
    missing = [reference for reference in request.references if reference not in items]
    if missing:
        return IRS.FAILED, result, "the check's result does not answer " + ", ".join(missing[:8])
    return IRS.COMPLETED, result, report.error


def proves_pull(reference: str, item: dict) -> bool:
    """Whether a check item shows the pulled image on the node: present, and for a bare
    repository answered by a repository match, its :latest (what a pull of it fetches)
    among the local tags."""
    if not item.get("present"):
        return False
    if item.get("match") == "repository":
        return any(tag.get("tag") == f"{reference}:latest" for tag in item.get("tags", []))
    return True


def _as_asked(references: list[str], result: dict) -> dict:
    if "images" not in result:
        return dict(result)
    images = []
    for item in result["images"]:
        asked = next((reference for reference in references if answers(reference, item.get("reference"))), None)
        images.append({**item, "reference": asked} if asked and asked != item.get("reference") else dict(item))
    return {**result, "images": images}


# --- the janitor ------------------------------------------------------------------------------


def retention() -> timedelta:
    return timedelta(days=settings.HETEROFLOW_IMAGE_REQUEST_RETENTION_DAYS)


def sweep_image_requests(now: datetime | None = None) -> dict[str, int]:
    """The janitor (the guarded job nodes.image_janitor, every minute): fail the open
    requests past their 2-hour budget, the processing ones without progress for 10
    minutes (claimed_at when none came yet), the pending ones of a node offline for more
    than 10 minutes; delete the finished ones older than the retention, in bounded
    batches. Returns how many of each."""
    now = now or utcnow()
    quiet = timedelta(seconds=IMAGE_STALLED_SECONDS)
    with transaction.atomic():
        counts = {
            "over_budget": _fail(
                ImageRequest.objects.filter(status__in=IMAGE_REQUEST_OPEN, deadline__lt=now),
                list(IMAGE_REQUEST_OPEN),
                OVER_BUDGET,
                now,
            ),
            "stalled": _fail(
                ImageRequest.objects.filter(status=IRS.PROCESSING)
                .annotate(last_sign=Coalesce(F("progress_at"), F("claimed_at"), F("created_at")))
                .filter(last_sign__lt=now - quiet),
                [IRS.PROCESSING],
                STALLED,
                now,
            ),
            "node_offline": _fail(
                ImageRequest.objects.filter(status=IRS.PENDING).filter(_offline_for(now, quiet)),
                [IRS.PENDING],
                NODE_OFFLINE,
                now,
            ),
        }
        counts["pruned"] = _prune(now - retention())
    return counts


def _offline_for(now: datetime, quiet: timedelta) -> Q:
    """The request's node has been offline for longer than `quiet`: silent since before
    (offline cut-off - quiet), never heard from, or signed off that long ago."""
    silent = Q(node__last_heartbeat_at__lt=liveness.offline_cutoff(now) - quiet)
    never = Q(node__last_heartbeat_at__isnull=True)
    farewell = Q(node__signed_off_at__gte=F("node__last_heartbeat_at"), node__signed_off_at__lt=now - quiet)
    return never | silent | farewell


def _fail(rows, from_statuses: list[str], error: str, now: datetime) -> int:
    ids = list(rows.order_by("id").values_list("id", flat=True)[:PRUNE_BATCH])
    return len(
        transition(
            ImageRequest, IMAGE_REQUEST_TRANSITIONS, ids, from_statuses, IRS.FAILED, error=error, finished_at=now
        )
    )


def _prune(before: datetime) -> int:
    pruned = 0
    for _ in range(PRUNE_BATCHES_PER_RUN):
        ids = list(
            ImageRequest.objects.filter(status__in=(IRS.COMPLETED, IRS.FAILED), finished_at__lt=before)
            .order_by("id")
            .values_list("id", flat=True)[:PRUNE_BATCH]
        )
        if not ids:
            break
        pruned += ImageRequest.objects.filter(pk__in=ids).delete()[0]
    return pruned
