"""Training borrows idle inference cards (spec 004, "训练借卡"), the inference app's half:

- `offer` (the cycle asks it, through apps.scheduler.lending's registry): the running,
  lendable services as data for the scheduler's pure core (apps.scheduler.core.lending),
  with what their autoscaler's latest gateway reading needs, and the loans whose borrower
  still waits;
- `lend` (the cycle, for a plan the core made): each service scaled down (or put to
  sleep when every replica is lent), a `borrowed` decision naming the task, the loan
  recorded; all the plan's services or none;
- `patrol_round` (the 15 s wake patrol, "训练借卡唤醒巡检 15s"): each open loan is given
  back when its training ended or never got the cards, or when the service has traffic
  again (the gateway woke it, its count went up, or its reading needs more than it was
  left with): the service rescaled or woken, and then, on traffic, the training
  preempted through the normal graceful stop (apps.scheduler.preemption.preempt).

Lock order (docs/architecture.md): a service row first, then its loan row, then task rows
(by id, move_tasks). The cycle takes the service row with SKIP LOCKED (it already holds
the rows it bound: it never waits for a service); the autoscaler and the patrol both
change the count by scale_service's compare-and-set on the count they read, so of a
patrol and an autoscaler at once one wins and the other changes nothing this round.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction

from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.inference import autoscale, load_readings, services
from apps.inference.choices import ServiceStatus
from apps.inference.models import InferenceService, LoanState, ServiceLoan
from apps.inference.selectors import replica_rows
from apps.inference.sleep import Event
from apps.scheduler.core import LendingService, LoanPlan
from apps.scheduler.lending import LendingBook
from apps.scheduler.preemption import ON_A_NODE, preempt
from apps.tasks.choices import TERMINAL
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task, TaskGroup

logger = logging.getLogger(__name__)

# A loan whose borrower is not placed within this long gives its cards back: someone
# else took them, or the training was placed elsewhere.
BIND_TIMEOUT = timedelta(seconds=120)
AWAKE = (ServiceStatus.STARTING, ServiceStatus.RUNNING, ServiceStatus.WAKING)
ENDED = (ServiceStatus.STOPPING, ServiceStatus.STOPPED, ServiceStatus.PAUSED)


# --- what the cycle reads ----------------------------------------------------------------------


def need_now(service: InferenceService, reading: load_readings.Reading, healthy: int) -> int | None:
    """The replicas the service's autoscaler would ask for on the gateway's reading now
    (autoscale.needs_of: its in-flight and tokens/s targets), or None: no in-flight
    reading (the gateway is away or never saw it) or an unreadable policy. Missing data
    never lends, as it never scales down."""
    if reading.in_flight is None:
        return None
    try:
        policy = services.scaling_policy(service)
    except autoscale.PolicyError:
        return None
    sample = autoscale.Sample(at=utcnow(), in_flight=reading.in_flight, tokens_per_s=reading.tokens_per_s)
    state = autoscale.ScalingState(replicas=service.replicas, healthy=healthy)
    needs = autoscale.needs_of(sample, policy, state)
    return max(need.replicas for need in needs) if needs else None


def offer(now: datetime | None = None) -> LendingBook:
    """The running lendable services of whole-card replicas, as lending sees them (a few
    queries and one Redis round trip, whatever their number), and the open loans whose
    borrower is still pending."""
    now = now or utcnow()
    book = LendingBook()
    loans = list(ServiceLoan.objects.filter(state=LoanState.OPEN).select_related("service__group", "borrower"))
    on_loan = {loan.service_id for loan in loans}
    statuses = borrower_statuses(loans)
    for loan in loans:
        if statuses[loan.pk] != S.PENDING:
            continue
        if loan.borrower_group_id is not None:
            waiting, key = book.waiting_groups, loan.borrower_group_id
        else:
            waiting, key = book.waiting, loan.borrower_id
        entry = waiting.setdefault(key, {"node_id": loan.node_id, "services": [], "replicas": []})
        entry["services"].append(loan_words(loan))
        entry["replicas"] = sorted({*entry["replicas"], *loan.replicas})
    found = list(
        InferenceService.objects.filter(state=ServiceStatus.RUNNING, lendable=True, memory_share=False).select_related(
            "group"
        )
    )
    if not found:
        return book
    rows = replica_rows([service.pk for service in found])
    readings = load_readings.read([service.pk for service in found], now)
    for service in found:
        counted = [row for row in rows[service.pk] if row["rank"] < service.replicas]
        surplus = [row for row in rows[service.pk] if row["rank"] >= service.replicas]
        settled = (
            len(counted) == service.replicas
            and all(row["status"] == S.RUNNING and row["healthy"] for row in counted)
            and all(row["status"] in TERMINAL for row in surplus)
        )
        healthy = sum(1 for row in counted if row["healthy"])
        slots = tuple(
            (row["task_id"], row["node_id"])
            for row in sorted(counted, key=lambda row: -row["rank"])
            if row["node_id"] and row["gpu_required"]
        )
        book.services.append(
            LendingService(
                id=service.pk,
                tenant_id=service.group.tenant_id,
                lendable=service.lendable,
                state=service.state,
                replicas=service.replicas,
                min_replicas=service.min_replicas,
                need=need_now(service, readings.get(service.pk, load_readings.Reading()), healthy),
                settled=settled and len(slots) == len(counted),
                on_loan=service.pk in on_loan,
                slots=slots,
                name=service.group.name,
            )
        )
    return book


def gang_status(statuses) -> str:
    """A borrowing task group's members' statuses as one borrower's status: terminal when
    every member has ended (the first's), on a node when any member is, pending when
    any waits in the queue, else ending (stopping, preempting: neither)."""
    statuses = list(statuses)
    if not statuses:
        return S.CANCELLED  # no member left: the group is gone
    if all(status in TERMINAL for status in statuses):
        return statuses[0]
    placed = [status for status in statuses if status in ON_A_NODE]
    if placed:
        return placed[0]
    return S.PENDING if S.PENDING in statuses else S.STOPPING


def borrower_statuses(loans) -> dict[int, str]:
    """loan id -> its borrower's status (a group's: gang_status), in one query for the
    groups' members."""
    group_ids = {loan.borrower_group_id for loan in loans if loan.borrower_group_id is not None}
    members: dict[int, list[str]] = {pk: [] for pk in group_ids}
    for group_id, status in (
        Task.objects.filter(group_id__in=group_ids).order_by("group_id", "rank").values_list("group_id", "status")
    ):
        members[group_id].append(status)
    return {
        loan.pk: gang_status(members[loan.borrower_group_id])
        if loan.borrower_group_id is not None
        else loan.borrower.status
        for loan in loans
    }


def loan_words(loan: ServiceLoan) -> dict:
    """A loan as a borrower's reason and explain show it."""
    return {
        "service_id": loan.service_id,
        "name": loan.service.group.name,
        "replicas": loan.from_replicas - loan.to_replicas,
        "sleeps": loan.sleeps,
    }


# --- lending (in the cycle's transaction) ------------------------------------------------------


class _NotLent(Exception):
    """One of the plan's services could not lend: the plan's savepoint is rolled back."""


def lend(plan: LoanPlan) -> bool:
    """Apply a loan plan: each service (in id order) scaled down by what it lends, or put
    to sleep when it lends every replica, with a `borrowed` decision naming the task, and
    its loan recorded. All or nothing: a service busy (its row locked), changed since the
    offer, or refusing (a Conflict) undoes the others; False then."""
    if plan.group_id is not None:
        name = TaskGroup.objects.filter(pk=plan.group_id).values_list("name", flat=True).first()
        borrower = name and f"training task group {plan.group_id} ({name})"
    else:
        name = Task.objects.filter(pk=plan.task_id).values_list("name", flat=True).first()
        borrower = name and f"training task {plan.task_id} ({name})"
    if not borrower:
        return False
    try:
        with transaction.atomic():
            for pk in sorted(plan.lent):
                _lend_one(pk, plan, borrower)
    except (_NotLent, Conflict, IntegrityError) as exc:
        logger.info("training task %s: the loan of %s was not made: %s", plan.task_id, sorted(plan.lent), exc)
        return False
    return True


def _lend_one(pk: int, plan: LoanPlan, borrower: str) -> None:
    service = (
        InferenceService.objects.select_for_update(skip_locked=True, of=("self",))
        .select_related("group", "model")
        .filter(pk=pk, state=ServiceStatus.RUNNING, lendable=True)
        .first()
    )
    if service is None or service.replicas != plan.counts[pk]:
        raise _NotLent(f"service {pk} is busy or changed since the offer")
    count, before = plan.lent[pk], service.replicas
    after = 0 if pk in plan.sleeps else before - count
    how = "put to sleep" if pk in plan.sleeps else f"scaled {before} → {after}"
    reason = (
        f"lent {count} idle replica{'s' if count != 1 else ''} ({services.replica_resources(service)} each) "
        f"to {borrower} on {', '.join(plan.nodes) if plan.nodes else plan.node_id}: {how}"
    )
    details = {"task_id": plan.task_id, "node_id": plan.node_id, "replicas": count}
    if plan.group_id is not None:
        details |= {"group_id": plan.group_id, "nodes": plan.nodes}
    if pk in plan.sleeps:
        done = services.move_service(
            service, Event.IDLE, source="lending", reason=reason, details=details, action="borrowed"
        )
    else:
        done = services.scale_service(
            service, after, source="lending", reason=reason, details=details, action="borrowed"
        )
    if not done:
        raise _NotLent(f"service {pk} moved meanwhile")
    stopped = set(plan.replicas)
    lent = [task_id for task_id, _ in _slots_from(service, before - count) if task_id in stopped]
    ServiceLoan.objects.create(
        service=service,
        borrower_id=plan.task_id,
        borrower_group_id=plan.group_id,
        node_id=plan.node_id,
        sleeps=pk in plan.sleeps,
        from_replicas=before,
        to_replicas=before - count,
        replicas=lent,
    )


def _slots_from(service: InferenceService, rank: int) -> list[tuple[int, int]]:
    return list(Task.objects.filter(group_id=service.pk, rank__gte=rank).order_by("rank").values_list("pk", "rank"))


# --- the wake patrol (15 s) --------------------------------------------------------------------


@dataclass(frozen=True)
class GiveBack:
    """Why an open loan is given back, and whether its training is preempted (traffic:
    the service wants its cards while the training holds them)."""

    why: str
    preempt: bool = False
    restore: bool = True  # the service rescaled or woken (not when it was stopped or paused)


def give_back_verdict(
    *,
    sleeps: bool,
    to_replicas: int,
    service_state: str,
    service_replicas: int,
    need: int | None,
    in_flight: int | None,
    borrower: str,
    borrower_status: str,
    borrower_node: str | None = None,
    lent_on: str = "",
    bound_at: datetime | None,
    lent_at: datetime,
    now: datetime,
) -> GiveBack | None:
    """The patrol's rule for one open loan (pure; None: the loan stands). In order: the
    service stopped or paused (nothing to give back to); the training ended, was
    requeued after holding the cards, was not placed within BIND_TIMEOUT, or was placed
    on another node than the lent cards' (others freed up first); the service has
    traffic: woken (it was put to sleep), its count raised above what it lent down to,
    or the gateway's reading needing more than that (then the training is preempted)."""
    if service_state in ENDED:
        return GiveBack(f"the service is {service_state}: the loan ends", restore=False)
    if borrower_status in TERMINAL:
        return GiveBack(f"{borrower} is {borrower_status}")
    if borrower_status == S.PENDING and bound_at is not None:
        return GiveBack(f"{borrower} gave the cards up (back in the queue)")
    if borrower_status == S.PENDING and now - lent_at >= BIND_TIMEOUT:
        waited = int((now - lent_at).total_seconds())
        return GiveBack(f"{borrower} was not placed on the lent cards within {waited} s")
    on_node = borrower_status in ON_A_NODE
    if on_node and borrower_node and lent_on and borrower_node != lent_on:
        return GiveBack(f"{borrower} was placed on {borrower_node}, not on the lent cards of {lent_on}")
    if sleeps and service_state in AWAKE:
        return GiveBack(f"traffic: the service was woken ({service_state})", preempt=on_node)
    if sleeps and in_flight:
        return GiveBack(f"traffic: {in_flight} requests in flight while asleep", preempt=on_node)
    if not sleeps and service_replicas > to_replicas:
        return GiveBack(
            f"traffic: its count went up to {service_replicas} (lent down to {to_replicas})", preempt=on_node
        )
    if not sleeps and need is not None and need > to_replicas:
        return GiveBack(
            f"traffic: the gateway's reading needs {need} replicas (lent down to {to_replicas})", preempt=on_node
        )
    return None


@dataclass
class PatrolResult:
    returned: dict[int, str] = field(default_factory=dict)  # loan id -> why
    preempted: list[int] = field(default_factory=list)  # borrowers moved to preempting
    bound: list[int] = field(default_factory=list)  # loans whose borrower was first seen placed
    failed: list[int] = field(default_factory=list)  # loans whose round raised (logged) or lost a race


def patrol_round(now: datetime | None = None) -> PatrolResult:
    """The 15 s wake patrol: every open loan judged (give_back_verdict) and, when it
    ends, given back (the service rescaled to its count before the loan, or woken) and,
    on traffic, its training preempted, each loan in its own savepoint."""
    now = now or utcnow()
    result = PatrolResult()
    loans = list(
        ServiceLoan.objects.filter(state=LoanState.OPEN)
        .select_related("service__group", "borrower")
        .order_by("service_id")
    )
    if not loans:
        return result
    readings = load_readings.read([loan.service_id for loan in loans], now)
    statuses = borrower_statuses(loans)
    for loan in loans:
        try:
            with transaction.atomic():
                reading = readings.get(loan.service_id, load_readings.Reading())
                _patrol_one(loan, statuses[loan.pk], reading, now, result)
        except Exception:
            logger.exception("wake patrol: loan %s failed", loan.pk)
            result.failed.append(loan.pk)
    return result


def _patrol_one(
    loan: ServiceLoan, status: str, reading: load_readings.Reading, now: datetime, result: PatrolResult
) -> None:
    """`status`: the borrower's as the round read it (a group's: gang_status)."""
    # the lock order: the service's row, then the loan's, then tasks (in the services)
    service = InferenceService.objects.select_for_update().select_related("group", "model").get(pk=loan.service_id)
    loan = ServiceLoan.objects.select_for_update().select_related("borrower").get(pk=loan.pk)
    if loan.state != LoanState.OPEN:
        return
    gang = loan.borrower_group_id is not None
    if not gang:
        status = loan.borrower.status
    if loan.bound_at is None and status in ON_A_NODE:
        ServiceLoan.objects.filter(pk=loan.pk).update(bound_at=now)
        loan.bound_at = now
        result.bound.append(loan.pk)
    healthy = sum(1 for row in replica_rows([service.pk])[service.pk] if row["healthy"])
    verdict = give_back_verdict(
        sleeps=loan.sleeps,
        to_replicas=loan.to_replicas,
        service_state=service.state,
        service_replicas=service.replicas,
        need=need_now(service, reading, healthy) if not loan.sleeps else None,
        in_flight=reading.in_flight,
        borrower=f"training task group {loan.borrower_group_id}" if gang else f"training task {loan.borrower_id}",
        borrower_status=status,
        borrower_node=None if gang else loan.borrower.node_id,  # a group's workers span nodes: not compared
        lent_on=loan.node_id,
        bound_at=loan.bound_at,
        lent_at=loan.created_at,
        now=now,
    )
    if verdict is None:
        return
    restored = _restore(service, loan, verdict.why) if verdict.restore else RESTORED
    if restored == RACED:
        result.failed.append(loan.pk)  # the autoscaler (or a user) changed the count first: next round
        return
    if verdict.preempt:
        # a group's every worker on a node: the gang is stopped whole, as it was placed
        members = Task.objects.filter(group_id=loan.borrower_group_id).values_list("pk", flat=True)
        result.preempted.extend(preempt(list(members) if gang else [loan.borrower_id]))
    if restored == NO_QUOTA:
        # the training still counts against the quota: once it is preempted (above, on
        # traffic) or ended, the next round gives the replicas back
        result.failed.append(loan.pk)
        return
    ServiceLoan.objects.filter(pk=loan.pk, state=LoanState.OPEN).update(
        state=LoanState.RETURNED, returned_at=now, returned_why=verdict.why[:500]
    )
    result.returned[loan.pk] = verdict.why


RESTORED, RACED, NO_QUOTA = "restored", "raced", "no_quota"


def _restore(service: InferenceService, loan: ServiceLoan, why: str) -> str:
    """The service back as it was before the loan, with a `returned` decision: woken when
    it was put to sleep and sleeps still, or scaled back up to its count before the loan
    (never above its max, never down). RACED: its state or count changed meanwhile (the
    CAS lost); NO_QUOTA: the quota has no room for the replicas yet (nothing written)."""
    details = {"task_id": loan.borrower_id, "loan_id": loan.pk}
    if loan.borrower_group_id is not None:
        details["group_id"] = loan.borrower_group_id
        reason = f"cards lent to training task group {loan.borrower_group_id} given back: {why}"
    else:
        reason = f"cards lent to training task {loan.borrower_id} given back: {why}"
    target = min(max(service.replicas, loan.from_replicas), service.max_replicas)
    try:
        with transaction.atomic():
            if loan.sleeps and service.state == ServiceStatus.SLEEPING:
                won = services.move_service(
                    service, Event.WAKE, source="lending", reason=reason, details=details, action="returned"
                )
                return RESTORED if won else RACED
            if not loan.sleeps and service.replicas < target:
                won = services.scale_service(
                    service, target, source="lending", reason=reason, details=details, action="returned"
                )
                return RESTORED if won else RACED
    except Conflict as exc:
        logger.info("wake patrol: service %s not given its replicas back yet: %s", service.pk, exc.detail)
        return NO_QUOTA
    services.record_decision(
        service,
        "lending",
        "returned",
        reason,
        from_replicas=service.replicas,
        to_replicas=service.replicas,
        details=details,
    )
    return RESTORED
