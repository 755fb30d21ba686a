"""Training borrows idle inference cards, the shell's half in the cycle: for each training
task, then each training task group, that did not fit (in queue order), the core plans a loan of idle replicas
(apps.scheduler.core.plan_loan) and the lender applies it. The lender is the inference
app's (apps.inference.lending, registered from its AppConfig.ready: the scheduler sits
below the workloads and never imports them): it offers the services as data
(LendingBook) and lends a plan (scales the services down or puts them to sleep, records
the loan). Nothing is bound here: the task waits (LoanPending) until the replicas have
stopped and their cards are free, as a preemptor waits for its victims."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from django.conf import settings as django_settings

from apps.scheduler.core import (
    Failure,
    GroupFailure,
    GroupReq,
    LendingService,
    LoanPlan,
    NodeSnap,
    PluginSettings,
    TaskReq,
    borrows,
    plan_group_loan,
    plan_loan,
)
from apps.scheduler.preemption import PREEMPTION_TRIGGERS


@dataclass
class LendingBook:
    """What the lender offers a cycle: the running inference services as lending sees
    them, and the loans still waiting for their borrower to be bound (borrower task id ->
    the loan as its reason shows it)."""

    services: list[LendingService] = field(default_factory=list)
    waiting: dict[int, dict] = field(default_factory=dict)
    waiting_groups: dict[int, dict] = field(default_factory=dict)  # borrowing task group id -> the loan


@dataclass(frozen=True)
class Lender:
    offer: Callable[[], LendingBook]
    lend: Callable[[LoanPlan], bool]  # True: lent (every service of the plan), False: nothing done


_lenders: list[Lender] = []


def register_lender(lender: Lender) -> None:
    """The inference app's lender (one; registering again replaces it)."""
    _lenders[:] = [lender]


def lender() -> Lender | None:
    return _lenders[0] if _lenders else None


@dataclass
class Loans:
    """What a cycle's lending step found: task id, and task group id, -> the loan it waits
    for, as its reason shows it (node_id, services, replicas; a group's also nodes)."""

    tasks: dict[int, dict] = field(default_factory=dict)
    groups: dict[int, dict] = field(default_factory=dict)


def lend_for(
    failures: list[Failure],
    tasks: dict[int, TaskReq],
    nodes: list[NodeSnap],
    settings: PluginSettings,
    may_share,
    group_failures: Sequence[GroupFailure] = (),
    groups: Mapping[int, GroupReq] | None = None,
) -> Loans:
    """After placement and preemption: for each training task, and each training task
    group, that did not fit for want of room (InsufficientResources,
    NoSchedulableNodes), in that order, the loan it waits for: one lent in an earlier
    cycle and not yet bound, or one planned and lent now. One offer a cycle, and a
    service lends to one borrower a cycle."""
    cap = django_settings.HETEROFLOW_INFERENCE_LEND_MAX_REPLICAS
    hopeful = [f for f in failures if f.code in PREEMPTION_TRIGGERS and borrows(tasks[f.task_id])]
    hopeful_groups = [
        f for f in group_failures if f.code in PREEMPTION_TRIGGERS and groups and borrows(groups[f.group_id])
    ]
    found = lender()
    loans = Loans()
    if not (hopeful or hopeful_groups) or found is None or cap <= 0:
        return loans
    book = found.offer()
    names = {service.id: service.name for service in book.services}
    taken: set[int] = set()

    def lent(plan: LoanPlan | None) -> dict | None:
        if plan is None:
            return None
        taken.update(plan.lent)  # tried once per cycle, lent or not (a service that refused is busy)
        return plan.as_reason(names) if found.lend(plan) else None

    for failure in hopeful:
        loan = book.waiting.get(failure.task_id) or lent(
            plan_loan(tasks[failure.task_id], nodes, book.services, settings, may_share, cap, taken)
        )
        if loan is not None:
            loans.tasks[failure.task_id] = loan
    for failure in hopeful_groups:
        loan = book.waiting_groups.get(failure.group_id) or lent(
            plan_group_loan(groups[failure.group_id], nodes, book.services, settings, may_share, cap, taken)
        )
        if loan is not None:
            loans.groups[failure.group_id] = loan
    return loans
