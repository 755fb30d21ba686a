"""One cycle: the queue and the snapshot read, the core's decision, bind, preemption,
training's loans of idle inference cards, and why the others wait written back; and a
dry run (the same decision for one request, binding nothing)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import orjson
from django.conf import settings as django_settings
from django.db import connection

from apps.core.clock import utcnow
from apps.scheduler import quotas
from apps.scheduler.bind import CARDS_GONE, EXPLAIN, NODE_GONE, BindOutcome, bind_decisions
from apps.scheduler.core import (
    CONSTRAINT_REASONS,
    Decision,
    Failure,
    GroupDecision,
    GroupFailure,
    GroupReq,
    NodeSnap,
    PreemptionPlan,
    TaskReq,
    as_bind_found,
    constraint_words,
    memory_detail,
    place_queue,
    rejections,
)
from apps.scheduler.core.defrag import DefragPlan, plan_defrag
from apps.scheduler.core.forecast import copy_nodes
from apps.scheduler.core.preemption import PREEMPTIBLE_KINDS
from apps.scheduler.core.queues import holdings_of
from apps.scheduler.core.suggestions import suggest as suggest_changes
from apps.scheduler.lending import lend_for
from apps.scheduler.plugins import plugin_settings, sharing_rule
from apps.scheduler.preemption import preempt_for, reclaim_for
from apps.scheduler.queue import (
    BATCH_SIZE,
    GroupWindow,
    group_window,
    next_batch_ordered,
    queue_state,
    replicas_on_nodes,
    task_request,
)
from apps.scheduler.reservations import reservation_reports, reserving_groups, standing_reservations, store_reservations
from apps.scheduler.snapshot import GpuRowCache, expected_ends, load_nodes


@dataclass
class CycleResult:
    considered: int = 0
    bound: list[int] = field(default_factory=list)
    lost_races: list[int] = field(default_factory=list)
    failed: dict[int, dict] = field(default_factory=dict)
    backlog: bool = False
    preemptions: dict[int, PreemptionPlan] = field(default_factory=dict)
    # training tasks waiting for idle inference replicas to stop (apps.scheduler.lending):
    # task id -> the loan as its reason shows it
    loans: dict[int, dict] = field(default_factory=dict)
    group_loans: dict[int, dict] = field(default_factory=dict)  # the same, for task groups
    # task groups: bound whole this cycle, and why the others wait (their members'
    # task ids are in bound / lost_races / failed as well)
    groups_bound: list[int] = field(default_factory=list)
    groups_failed: dict[int, dict] = field(default_factory=dict)
    # seconds spent in each phase, for the benchmark and the cycle metrics
    phases: dict[str, float] = field(default_factory=dict)


EXPLAIN_GROUPS = """
    UPDATE task_groups AS g SET schedule_reason = v.reason
    FROM unnest(%s::bigint[], %s::jsonb[]) AS v(id, reason) WHERE g.id = v.id
"""


def run_cycle(batch_size: int = BATCH_SIZE, gpu_rows: GpuRowCache | None = None) -> CycleResult:
    """One cycle. `gpu_rows`: the GPU rows the caller keeps between its cycles (the tick's),
    reused for HETEROFLOW_SCHEDULER_GPU_REUSE_SECONDS; without it they are read afresh."""
    # A cycle allocates tens of thousands of short-lived objects (the snapshot) that the
    # cyclic collector would traverse again and again; reference counting frees them.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run_cycle(batch_size, gpu_rows)
    finally:
        if collecting:
            gc.enable()


def _run_cycle(batch_size: int, gpu_rows: GpuRowCache | None) -> CycleResult:
    result = CycleResult()
    clock = PhaseClock(result.phases)
    ordered = next_batch_ordered(batch_size)
    batch = [task for task, _ in ordered]
    result.backlog, groups_waiting = queue_state(len(batch))
    window = group_window() if groups_waiting else GroupWindow()
    groups = window.entries
    result.considered = len(batch) + sum(group.world_size for group, _ in groups)
    if not batch and not groups:
        return result
    # one queue: a group is decided after the singles ahead of it (higher priority, or
    # older at the same priority) and before those behind it
    queue = [item for item, _ in sorted([*ordered, *groups], key=lambda entry: entry[1])]
    may_share = sharing_rule()
    settings = plugin_settings()
    clock.lap("queue")
    nodes = load_nodes(django_settings.HETEROFLOW_SCHEDULER_GPU_REUSE_SECONDS, gpu_rows)
    siblings = replicas_on_nodes(batch)  # where the batch's services run already (no query without replicas)
    started = utcnow()
    book = quotas.queue_book(started, used=holdings_of(nodes))  # the tenants' queues (docs/queues.md)
    clock.lap("snapshot")
    reserve_after = django_settings.HETEROFLOW_GROUP_RESERVE_AFTER_SECONDS
    reserving = reserving_groups(window.heads, started, reserve_after)
    # backfill: only while a gang reserves is there anything to date or to fill
    ends = expected_ends(started) if reserving else None
    placement = place_queue(
        queue,
        nodes,
        settings,
        may_share,
        reserving=reserving,
        siblings=siblings,
        book=book,
        now=started.timestamp(),
        ends=ends,
    )
    decisions, failures = placement.decisions, placement.failures
    clock.lap("decide")
    tasks = {task.id: task for task in batch}
    tasks_alone = set(tasks)
    for group, _ in groups:
        tasks.update((member, group.worker(rank)) for rank, member in enumerate(group.members))
    outcome = bind_decisions(decisions, tasks, may_share, settings, groups=placement.groups)
    result.bound, result.lost_races = outcome.bound, outcome.lost
    bound = set(result.bound)
    result.groups_bound = [g.group_id for g in placement.groups if g.decisions[0].task_id in bound]
    clock.lap("bind")
    if outcome.refused:
        # a decision bind refused because its node had changed is the failure placement
        # would have met on the live rows: preemption considers it like one, once, in
        # this cycle, on its node as bind found it (never by deciding and binding again)
        failures = refused_at_bind(failures, outcome, decisions, queue)
        nodes = as_bound(nodes, outcome)
    result.preemptions = preempt_for(failures, tasks, nodes, settings, may_share, placement.siblings)
    if book.cohorts:  # a queue's reclaim: a task within its nominal stops the cohort's borrowed work
        result.preemptions |= reclaim_for(failures, tasks, nodes, settings, may_share, book, result.preemptions)
    # training borrows idle inference cards (single tasks; a group's members never borrow one by one)
    singles = [failure for failure in failures if failure.task_id in tasks_alone]
    requests = {group.id: group for group, _ in groups}
    loans = lend_for(singles, tasks, nodes, settings, may_share, placement.group_failures, requests)
    result.loans, result.group_loans = loans.tasks, loans.groups
    clock.lap("preempt")
    now = utcnow().isoformat()
    for failure in failures:
        reason = failure.as_reason() | {"at": now}
        plan = result.preemptions.get(failure.task_id)
        if plan is not None:
            # the preemptor waits: next cycle binds against the real ledger
            reason |= {
                "code": "PreemptionPending",
                "cause": failure.code,
                "preemption": {"node_id": plan.node_id, "victims": plan.victims},
            }
        loan = result.loans.get(failure.task_id)
        if loan is not None:
            # the borrower waits: the lent replicas stop, next cycles bind it on their cards
            reason |= {"code": "LoanPending", "cause": failure.code, "loan": loan}
        result.failed[failure.task_id] = reason
    members = {group.id: group.members for group, _ in groups}
    reports = reservation_reports(window.heads, placement.group_failures, started, reserve_after)
    for failure in placement.group_failures:
        reason = result.groups_failed[failure.group_id] = failure.as_reason() | {"at": now}
        if failure.group_id in reports:
            reason["reservation"] = reports[failure.group_id]
        loan = result.group_loans.get(failure.group_id)
        if loan is not None:
            reason |= {"code": "LoanPending", "cause": failure.code, "loan": loan}
        # the members say why in a line and point at the group, which has the details
        brief = {key: value for key, value in reason.items() if key != "reservation"} | {"group": failure.group_id}
        for member in members[failure.group_id]:
            result.failed[member] = brief
    store_reservations(reports)
    if result.failed:
        with connection.cursor() as cursor:
            cursor.execute(
                EXPLAIN, [list(result.failed), [orjson.dumps(reason).decode() for reason in result.failed.values()]]
            )
            if result.groups_failed:
                cursor.execute(
                    EXPLAIN_GROUPS,
                    [
                        list(result.groups_failed),
                        [orjson.dumps(reason).decode() for reason in result.groups_failed.values()],
                    ],
                )
    clock.lap("explain")
    return result


def refused_at_bind(
    failures: list[Failure], outcome: BindOutcome, decisions: list[Decision], queue: list
) -> list[Failure]:
    """The placement failures and the decisions bind refused because the node had changed
    (each a Failure with bind's reason and a message naming the node), in queue order."""
    on = {decision.task_id: decision.node_id for decision in decisions}
    refused = [
        Failure(task_id, code, {}, refusal_message(code, on[task_id])) for task_id, code in outcome.refused.items()
    ]
    position = {item.id: index for index, item in enumerate(queue) if isinstance(item, TaskReq)}
    return sorted([*failures, *refused], key=lambda failure: position.get(failure.task_id, len(position)))


def refusal_message(code: str, node_id: str) -> str:
    if code == NODE_GONE:
        return f"placed on {node_id}, which took no more work by the time it was bound"
    if code == CARDS_GONE:
        return f"placed on {node_id}, whose chosen cards were taken or became unusable before it was bound"
    return f"placed on {node_id}, whose cards came to hold a tenant's work it may not share with before it was bound"


def as_bound(nodes: list[NodeSnap], outcome: BindOutcome) -> list[NodeSnap]:
    """The snapshot with the nodes of the refused decisions as bind found them."""
    lost = set(outcome.lost)
    return [as_bind_found(node, outcome.found[node.id], lost) if node.id in outcome.found else node for node in nodes]


class PhaseClock:
    def __init__(self, into: dict[str, float]):
        self.into = into
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = now - self.last
        self.last = now


# The running tasks a defragmentation plan may move: single whole-card jobs marked
# preemptible, the kind preemption may stop (core.preemption.PREEMPTIBLE_KINDS), as the
# queue's columns give them.
MOVABLE_SQL = """
    SELECT id, tenant_id, gpu_required, gpu_memory_mb, gpu_type, priority, labels, kind, group_id,
           runtime, affinity, anti_affinity, max_duration_seconds
    FROM tasks
    WHERE status = 'running' AND preemptible AND kind = ANY(%s) AND group_id IS NULL AND gpu_required > 0
"""


def defrag_advice(gang: GroupReq) -> DefragPlan | None:
    """For operators: the fewest moves of preemptible tasks after which a waiting gang
    fits (core.defrag), on a fresh snapshot."""
    with connection.cursor() as cursor:
        cursor.execute(MOVABLE_SQL, [sorted(PREEMPTIBLE_KINDS)])
        movable = {row[0]: task_request(*row) for row in cursor.fetchall()}
    if not movable:
        return None
    return plan_defrag(gang, load_nodes(), plugin_settings(), sharing_rule(), movable)


def dry_run(request: TaskReq | GroupReq) -> Decision | Failure | GroupDecision | GroupFailure:
    """Where a task or a task group would go now, or why not: against a fresh snapshot
    and behind the reservations standing for its priority or higher, binding nothing."""
    return explain_now(request)[0]


def explain_now(
    request: TaskReq | GroupReq, *, suggest: bool = False
) -> tuple[Decision | Failure | GroupDecision | GroupFailure, dict]:
    """dry_run, and for a task that does not fit what the explanation adds to its reason
    (computed here, on the same snapshot, never in the cycle): `nodes`, each node the
    chain removes with the filter that removed it (core.rejections); `message`, in
    words, how its runtime, node labels or service kept nodes off, naming a wanted label
    no node has (core.constraint_words); and, when what the cards' readings say is in use
    keeps it off (`memory_in_use`), `cards`: where, with the ledger's and the measured
    free memory, the reserve and what it needs (core.memory_detail). With `suggest`, a
    task or group that does not fit also gets `suggestions`: the smallest changes that
    the same placement, on the same snapshot, would place (core.suggestions)."""
    exclude = request.id if isinstance(request, GroupReq) else None
    nodes, settings, may_share = load_nodes(), plugin_settings(), sharing_rule()
    siblings = replicas_on_nodes([request]) if isinstance(request, TaskReq) else {}
    held = standing_reservations(request.priority, exclude=exclude)
    now = utcnow()
    ends = expected_ends(now) if held else None
    pristine = copy_nodes(nodes) if suggest else []

    def place(work: TaskReq | GroupReq, fleet: list[NodeSnap]):
        return place_queue(
            [work], fleet, settings, may_share, held=held, siblings=siblings, now=now.timestamp(), ends=ends
        )

    placement = place(request, nodes)
    outcomes = [*placement.decisions, *placement.failures, *placement.groups, *placement.group_failures]
    outcome = outcomes[0]
    detail: dict = {}
    if suggest and isinstance(outcome, (Failure, GroupFailure)):

        def places(changed: TaskReq | GroupReq) -> bool:
            trial = place(changed, copy_nodes(pristine))
            return bool(trial.decisions or trial.groups)

        detail["suggestions"] = suggest_changes(request, pristine, places)
    if isinstance(outcome, Failure):
        # the placement took nothing (it failed): the snapshot is as it was read
        apart = siblings.get(request.replica_of) if request.replica_of is not None else None
        detail["nodes"] = rejections(request, nodes, settings, may_share, apart)
        if CONSTRAINT_REASONS & set(outcome.removed):
            detail["message"] = "; ".join(constraint_words(request, nodes, outcome.removed))
        if "memory_in_use" in outcome.removed:
            detail["cards"] = memory_detail(request, nodes, settings, may_share)
    return outcome, detail
