"""The queues' pure core (apps.scheduler.core.queues): admission within nominal, by
borrowing from the cohort's idle nominal (limits on both sides), the refusals in words,
the fair-share order, and which work a reclaim may stop."""

from __future__ import annotations

import random

import pytest

from apps.scheduler.core import PluginSettings, place_queue
from apps.scheduler.core.queues import (
    QueueBook,
    QueueSpec,
    Quota,
    Work,
    borrowed_work,
    decayed,
    fair_order,
    reclaim_order,
)
from tests.scheduler.snapshots import group, node, task

NV = "nvidia"


def book(used=None, history=None, **overrides):
    specs = {
        1: QueueSpec(1, "acme", "research", 1.0, {NV: Quota(16)}),
        2: QueueSpec(2, "globex", "research", 1.0, {NV: Quota(16)}),
        3: QueueSpec(3, "initech", None, 1.0, {NV: Quota(8)}),
    }
    specs.update(overrides)
    return QueueBook(specs.values(), used or {}, history or {})


def test_within_nominal_is_admitted_and_a_tenant_without_a_queue_is_not_limited():
    queues = book({(1, NV): 10})
    assert queues.admit(1, NV, 6).admitted
    assert queues.admit(99, NV, 1000).admitted  # no queue: as before queues existed


def test_above_nominal_borrows_the_cohorts_idle_nominal():
    queues = book({(1, NV): 16, (2, NV): 4})  # globex idles 12
    verdict = queues.admit(1, NV, 8)
    assert verdict.admitted and verdict.borrowed == 8
    queues.take(1, NV, 8)
    refused = queues.admit(1, NV, 8)  # 16 more above nominal > the 12 globex idles
    assert not refused.admitted and refused.reason == "cohort_exhausted"
    assert refused.words == "acme is at 24/16 nominal nvidia, and the cohort research has 4 idle nvidia cards to lend"


def test_a_tenant_in_no_cohort_never_borrows():
    queues = book({(3, NV): 8, (1, NV): 0})
    verdict = queues.admit(3, NV, 1)
    assert not verdict.admitted and verdict.reason == "over_nominal"
    assert verdict.words == "initech is at 8/8 nominal nvidia, and it is in no cohort to borrow from"


def test_the_borrowing_limit_and_the_lending_limit_bound_a_loan():
    limited = QueueBook(
        [
            QueueSpec(1, "acme", "research", 1.0, {NV: Quota(16, borrowing_limit=4)}),
            QueueSpec(2, "globex", "research", 1.0, {NV: Quota(16)}),
        ],
        {(1, NV): 16},
    )
    assert limited.admit(1, NV, 4).admitted
    over = limited.admit(1, NV, 5)
    assert over.reason == "borrowing_limit" and "borrowing limit of 4" in over.words
    lender_capped = QueueBook(
        [
            QueueSpec(1, "acme", "research", 1.0, {NV: Quota(16)}),
            QueueSpec(2, "globex", "research", 1.0, {NV: Quota(16, lending_limit=6)}),
        ],
        {(1, NV): 16},
    )
    assert lender_capped.admit(1, NV, 6).admitted
    assert lender_capped.admit(1, NV, 7).reason == "cohort_exhausted"
    assert book({(1, NV): 16}).admit(1, NV, 16).admitted  # no limits: all of globex's idle 16


def test_what_one_member_borrows_is_not_lent_twice():
    queues = QueueBook(
        [
            QueueSpec(1, "acme", "research", 1.0, {NV: Quota(8)}),
            QueueSpec(2, "globex", "research", 1.0, {NV: Quota(8)}),
            QueueSpec(4, "hooli", "research", 1.0, {NV: Quota(8)}),
        ],
        {(1, NV): 8, (2, NV): 14, (4, NV): 0},  # globex borrows 6 of hooli's idle 8
    )
    assert queues.admit(1, NV, 2).admitted
    assert queues.admit(1, NV, 3).reason == "cohort_exhausted"


def test_a_shared_card_counts_as_its_share():
    queues = book({(1, NV): 15.5})
    assert queues.admit(1, NV, 0.5).admitted and not queues.borrows(1, NV, 0.5)
    assert queues.borrows(1, NV, 0.75)


def test_a_type_without_a_quota_has_nominal_zero():
    queues = book({(2, NV): 0})
    assert queues.admit(1, "ascend", 1).reason == "cohort_exhausted"  # nobody in the cohort has ascend nominal


def test_the_fair_share_order_is_decayed_usage_above_nominal_over_weight():
    queues = QueueBook(
        [
            QueueSpec(1, "acme", "research", 1.0, {NV: Quota(8)}),
            QueueSpec(2, "globex", "research", 2.0, {NV: Quota(8)}),
            QueueSpec(4, "hooli", "research", 1.0, {NV: Quota(8)}),
        ],
        history={1: 100.0, 2: 150.0, 4: 50.0},
    )
    assert fair_order(queues, [1, 2, 4]) == [4, 2, 1]  # 50, 75, 100
    assert decayed(100.0, 7 * 86400, 7 * 86400) == pytest.approx(50.0)
    assert decayed(100.0, 0, 7 * 86400) == 100.0


def test_only_work_beyond_a_borrowers_nominal_is_reclaimed_lowest_priority_then_newest():
    queues = book({(1, NV): 4, (2, NV): 24})  # globex borrows 8
    works = [
        Work(11, 2, NV, 8, priority=0, started_at=1.0),  # within globex's nominal (oldest)
        Work(12, 2, NV, 8, priority=0, started_at=2.0),  # within
        Work(13, 2, NV, 4, priority=5, started_at=3.0),  # beyond: borrowed
        Work(14, 2, NV, 4, priority=0, started_at=4.0),  # beyond: borrowed
        Work(21, 1, NV, 4, priority=0, started_at=5.0),  # the reclaimer's own
    ]
    assert [work.id for work in borrowed_work(queues, works)] == [13, 14]
    assert [work.id for work in reclaim_order(queues, 1, NV, works)] == [14, 13]
    assert queues.may_reclaim(1, NV, 8) and not queues.may_reclaim(1, NV, 16)  # 20 > 16: not its nominal
    assert reclaim_order(queues, 3, NV, works) == []  # no cohort: reclaims nothing


def test_properties_over_random_books():
    """However the cards are held, an admitted placement never takes a borrower past its
    borrowing limit, nor what the cohort borrows past what its other members lend."""
    rnd = random.Random(7)
    for _ in range(500):
        specs = [
            QueueSpec(
                i,
                f"t{i}",
                "c",
                1.0,
                {
                    NV: Quota(
                        rnd.randint(0, 16), rnd.choice([None, rnd.randint(0, 8)]), rnd.choice([None, rnd.randint(0, 8)])
                    )
                },
            )
            for i in range(1, 5)
        ]
        queues = QueueBook(specs, {(i, NV): float(rnd.randint(0, 8)) for i in range(1, 5)})
        for _ in range(20):
            tenant, cards = rnd.randint(1, 4), rnd.randint(1, 6)
            if not queues.admit(tenant, NV, cards).admitted:
                continue
            before = queues.above_nominal(tenant, NV)
            queues.take(tenant, NV, cards)
            quota = queues.specs[tenant].quota(NV)
            if queues.above_nominal(tenant, NV) > before:  # it borrowed
                if quota.borrowing_limit is not None:
                    assert queues.above_nominal(tenant, NV) <= quota.borrowing_limit + 1e-9
                assert queues.cohort_borrowed("c", NV) <= queues.cohort_lendable("c", NV, besides=tenant) + 1e-9


def test_a_borrower_that_found_no_room_after_others_is_told_who_came_first():
    """globex idle with 16 nominal; acme (nominal 0) and hooli (nominal 0) both borrow 8
    cards of an 8-card fleet; acme's lower share goes first, hooli hears it came second."""
    specs = [
        QueueSpec(1, "acme", "research", 1.0, {NV: Quota(0)}),
        QueueSpec(2, "globex", "research", 1.0, {NV: Quota(16)}),
        QueueSpec(4, "hooli", "research", 1.0, {NV: Quota(0)}),
    ]
    queue = [task(id=10, gpus=8, tenant=4, gpu_type=NV), task(id=11, gpus=8, tenant=1, gpu_type=NV)]
    placement = place_queue(
        queue, [node("n0")], PluginSettings(), lambda a, b: True, book=QueueBook(specs, {}, {4: 3600.0})
    )
    assert [d.task_id for d in placement.decisions] == [11]
    [failure] = placement.failures
    assert failure.message == (
        "hooli is at 0/0 nominal nvidia, and 1 tenant (acme) came before it in fair share "
        "for the cohort research's idle cards"
    )
    assert failure.queue["ahead"] == ["acme"] and failure.as_reason()["queue"]["cohort"] == "research"

    # a group says it too, after its own words
    gang = group(id=5, workers=1, gpus=8, tenant=4, gpu_type=NV)
    placement = place_queue(
        [gang, queue[1]], [node("n0")], PluginSettings(), lambda a, b: True, book=QueueBook(specs, {}, {4: 3600.0})
    )
    [failure] = placement.group_failures
    assert "1 tenant (acme) came before it in fair share" in failure.message
    assert failure.queue["ahead"] == ["acme"]


def test_no_fair_share_words_without_a_borrower_ahead():
    placement = place_queue(
        [task(id=12, gpus=9, tenant=1, gpu_type=NV)], [node("n0")], PluginSettings(), lambda a, b: True, book=book()
    )
    [failure] = placement.failures
    assert failure.message == "" and failure.queue is None
