"""Queues through the real cycle (docs/queues.md): borrowing the cohort's idle nominal, a
tenant in no cohort held to its nominal with the queue's words, a reclaim that stops
only the borrower's work beyond its nominal (the graceful way, saying who reclaimed it),
the fair-share order among borrowers, and a tenant with no queue left alone."""

from __future__ import annotations

import pytest

from apps.scheduler import quotas
from apps.scheduler.services import run_cycle
from apps.tasks.services import agent_report
from apps.tenants import services
from apps.tenants.models import TenantQueue
from tests.factories import make_node, make_task
from tests.headers import bearer
from tests.scheduler.ledger import ledger_agrees

pytestmark = pytest.mark.django_db

NV = "nvidia"


def queue(tenant, nominal, cohort="research", weight=1.0, **limits):
    quotas.set_queue(tenant, cohort=cohort, weight=weight, quotas=[quotas.QuotaInput(NV, nominal, **limits)])


def run(tasks):
    """Bind what the next cycle binds of `tasks`, and report each bound one running."""
    result = run_cycle()
    for task in tasks:
        task.refresh_from_db()
        if task.status == "scheduled":
            assert agent_report(task, from_status="scheduled", to_status="running")
            task.refresh_from_db()
    return result


def job(tenant, name, gpus=1, priority=50):
    return make_task(tenant, name=name, gpu_required=gpus, gpu_type=NV, priority=priority)


def test_a_tenant_borrows_the_cohorts_idle_nominal_and_no_more(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    make_node("n1", gpus=4)
    queue(acme, 1)
    queue(beta, 2)  # of 4 cards: 1 free of anyone's nominal, which nobody lends
    tasks = [job(acme, f"a{i}") for i in range(4)]
    result = run(tasks)
    assert sorted(result.bound) == sorted(task.pk for task in tasks[:3])  # its 1 + beta's idle 2
    words = result.failed[tasks[3].pk]
    assert words["code"] == "QueueLimit"
    assert words["message"] == "acme is at 3/1 nominal nvidia, and the cohort research has 0 idle nvidia cards to lend"
    assert words["queue"] == {
        "tenant": "acme",
        "gpu_type": "nvidia",
        "nominal": 1,
        "used": 3.0,
        "asked": 1.0,
        "cohort": "research",
        "lendable": 0.0,
    }
    assert ledger_agrees()


def test_explain_gives_the_queues_words_and_figures(api, world):
    acme = world.tenants["acme"]
    make_node("n1", gpus=2)
    queue(acme, 1, cohort=None)
    tasks = [job(acme, f"a{i}") for i in range(2)]
    run(tasks)
    answer = api.get(f"/api/v1/tasks/{tasks[1].pk}/explain", **bearer(world.keys["acme-member"])).json()
    reason = answer["schedule_reason"]
    assert reason["code"] == "QueueLimit" and reason["queue"]["cohort"] is None
    assert reason["message"] == "acme is at 1/1 nominal nvidia, and it is in no cohort to borrow from"


def test_a_tenant_in_no_cohort_runs_within_its_nominal(world):
    acme = world.tenants["acme"]
    make_node("n1", gpus=4)
    queue(acme, 2, cohort=None)
    tasks = [job(acme, f"a{i}") for i in range(3)]
    result = run(tasks)
    assert len(result.bound) == 2
    assert result.failed[tasks[2].pk]["message"] == (
        "acme is at 2/2 nominal nvidia, and it is in no cohort to borrow from"
    )


def test_a_tenant_without_a_queue_is_not_limited(world):
    make_node("n1", gpus=4)
    queue(world.tenants["beta"], 4)
    tasks = [job(world.tenants["acme"], f"a{i}") for i in range(4)]
    assert len(run(tasks).bound) == 4


def test_a_reclaim_stops_only_the_borrowers_work_beyond_its_nominal(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    make_node("n1", gpus=4)
    queue(acme, 2)
    queue(beta, 2)
    oldest = job(acme, "within-1", priority=10)
    older = job(acme, "within-2", priority=10)
    run([oldest, older])
    borrowed = [job(acme, "borrowed-1", priority=90), job(acme, "borrowed-2", priority=90)]
    run(borrowed)  # acme holds all 4: 2 of them beta's idle nominal
    assert all(task.status == "running" for task in borrowed)
    mine = job(beta, "mine", gpus=1, priority=1)  # low priority: the reclaim is by nominal, not priority
    result = run([mine])
    plan = result.preemptions[mine.pk]
    assert len(plan.victims) == 1 and plan.victims[0] in {task.pk for task in borrowed}
    victim = next(task for task in borrowed if task.pk == plan.victims[0])
    victim.refresh_from_db()
    assert victim.status == "preempting"
    assert victim.schedule_reason["message"] == "reclaimed by beta (its nominal)"
    for task in (oldest, older):
        task.refresh_from_db()
        assert task.status == "running"  # within acme's nominal: never touched
    mine.refresh_from_db()
    assert mine.schedule_reason["code"] == "PreemptionPending"
    # the agent confirms the stop: the victim is back in the queue, beta's task binds, and
    # acme's victim may not borrow the card back
    assert agent_report(victim, from_status="preempting", to_status="pending")
    result = run([mine, victim])
    assert mine.pk in result.bound and victim.pk not in result.bound
    assert ledger_agrees()


def test_borrowers_take_idle_cards_lowest_dominant_share_first(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    make_node("n1", gpus=2)
    queue(acme, 0)
    queue(beta, 0)
    lender = TenantQueue.objects.get(tenant=beta)
    lender.usage_above_nominal = 50 * 3600.0  # beta borrowed a lot lately
    lender.save(update_fields=["usage_above_nominal"])
    idle = services.create_tenant(name="Idle", slug="idle")  # a third member lends its 2 idle cards
    queue(idle, 2)
    first = job(beta, "beta-first", priority=90)  # older and higher priority, but beta's share is larger
    second = job(acme, "acme-second", priority=10)
    third = job(beta, "beta-third")
    result = run([first, second, third])
    assert second.pk in result.bound  # acme first: it has borrowed nothing
    assert len(result.bound) == 2 and first.pk in result.bound and third.pk not in result.bound
