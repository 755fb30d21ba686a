"""The quota's usage kept as a counter (tenant_usage): it equals a count of the tenant's
active tasks after any sequence of creates and moves, whatever writes the task rows."""

import random
from datetime import timedelta

import pytest
from django.db.models import Count, F, Sum
from django.db.models.functions import Coalesce, Greatest

from apps.alerts.failures import adjudicate_lost_runs, fail_overdue_queue, sweep_offline_nodes
from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.nodes.models import Node
from apps.tasks import services
from apps.tasks.choices import ACTIVE, TRANSITIONS
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task, TenantUsage
from tests.factories import make_node, make_task

pytestmark = pytest.mark.django_db


def scanned(tenant) -> dict:
    """The quota's usage the slow way, as it was counted before the counter."""
    return Task.objects.filter(tenant=tenant, status__in=ACTIVE).aggregate(
        tasks=Count("id"),
        gpus=Coalesce(Sum("gpu_required"), 0),
        gpu_memory_mb=Coalesce(Sum(F("gpu_memory_mb") * Greatest(F("gpu_required"), 1)), 0),
    )


def test_the_counter_counts_exactly_the_statuses_the_quota_counts(world):
    """The triggers' list of statuses that do not count agrees with choices.ACTIVE."""
    tenant = world.tenants["acme"]
    for status in S:
        before = services.quota_use(tenant)
        task = make_task(tenant, status=status, gpu_required=2, gpu_memory_mb=100)
        after = services.quota_use(tenant)
        counted = status in ACTIVE
        assert after == {
            "tasks": before["tasks"] + counted,
            "gpus": before["gpus"] + 2 * counted,
            "gpu_memory_mb": before["gpu_memory_mb"] + 200 * counted,
        }, status
        task.delete()
        assert services.quota_use(tenant) == before


def a_task(rng, tenant, statuses):
    """One of the tenant's tasks in `statuses`, chosen by `rng` (None: there is none)."""
    ids = list(Task.objects.filter(tenant=tenant, status__in=statuses).order_by("pk").values_list("pk", flat=True))
    return Task.objects.get(pk=rng.choice(ids)) if ids else None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_counter_equals_a_scan_after_random_creates_and_moves(world, seed):
    rng = random.Random(seed)
    tenant = world.tenants["acme"]
    node = make_node(f"counter-{seed}", gpus=8)
    rack = make_node(f"counter-{seed}-rack", gpus=8)  # goes silent now and then

    def create():
        specs = [
            {
                "name": "r",
                "image": "x",
                "gpu_required": rng.randint(0, 3),
                "gpu_memory_mb": rng.choice([None, 1000, 24_000]),
            }
            for _ in range(rng.randint(1, 4))
        ]
        services.create_tasks(tenant, specs)

    def bind():
        if task := a_task(rng, tenant, [S.PENDING]):
            services.move_tasks(task.pk, [S.PENDING], S.SCHEDULED, node=rng.choice([node, rack]))

    def start():
        if task := a_task(rng, tenant, [S.SCHEDULED]):
            try:
                services.agent_report(task, from_status=S.SCHEDULED, to_status=S.RUNNING)
            except Conflict:  # a memory-only task bound here without a slice never starts
                assert task.gpu_required == 0 and task.gpu_memory_mb

    def end():
        if task := a_task(rng, tenant, [S.RUNNING]):
            services.agent_report(task, from_status=S.RUNNING, to_status=rng.choice([S.COMPLETED, S.FAILED]))

    def fail_any():
        if task := a_task(rng, tenant, [s for s in ACTIVE if S.FAILED in TRANSITIONS[s]]):
            services.move_tasks(task.pk, [task.status], S.FAILED, error_message="random")

    def stop():
        if task := a_task(rng, tenant, [*services.CANCEL_FROM, *services.STOP_FROM]):
            services.stop_task(task)

    def stopped():
        if task := a_task(rng, tenant, [S.STOPPING]):
            services.agent_report(task, from_status=S.STOPPING, to_status=S.STOPPED)

    def requeue():
        if task := a_task(rng, tenant, [*services.REQUEUE_AT_ONCE, *services.REQUEUE_AFTER_STOP]):
            services.requeue_tasks([task.pk], why="random")

    def preempt():
        if task := a_task(rng, tenant, [S.RUNNING]):
            services.move_tasks(task.pk, [S.RUNNING], S.PREEMPTING)
            if rng.random() < 0.7:
                services.requeue_preempted([task.pk])

    def lost():
        if task := a_task(rng, tenant, [S.RUNNING]):
            adjudicate_lost_runs([task.pk], node_id=task.node_id, cause="container_lost")

    def node_silent():  # the alert sweep requeues (or ends) what the silent node ran
        Node.objects.filter(pk=rack.pk).update(last_heartbeat_at=utcnow() - timedelta(minutes=10))
        sweep_offline_nodes()
        Node.objects.filter(pk=rack.pk).update(last_heartbeat_at=utcnow())

    def queue_timeout():
        if rng.random() < 0.2:
            fail_overdue_queue(now=utcnow() + timedelta(days=30))

    def delete():
        if task := a_task(rng, tenant, list(S)):
            task.delete()

    def edit():  # an operator's edit in the admin
        if task := a_task(rng, tenant, list(S)):
            Task.objects.filter(pk=task.pk).update(
                gpu_required=rng.randint(0, 4), gpu_memory_mb=rng.choice([None, 500])
            )

    steps = [create] * 6 + [
        bind,
        bind,
        start,
        start,
        end,
        fail_any,
        stop,
        stopped,
        requeue,
        preempt,
        lost,
        node_silent,
        queue_timeout,
        delete,
        edit,
    ]
    for step in range(150):
        rng.choice(steps)()
        assert services.quota_use(tenant) == scanned(tenant), f"after step {step}"
    assert Task.objects.filter(tenant=tenant).exists()


def test_a_batch_is_one_counter_update_and_all_or_nothing(world):
    tenant = world.tenants["acme"]
    tenant.max_concurrent_tasks = 10
    tenant.save()
    services.create_tasks(tenant, [{"name": "a", "image": "x"}] * 6)
    assert services.quota_use(tenant)["tasks"] == 6
    with pytest.raises(Conflict, match="6 of 10 concurrent tasks in use, 5 more asked"):
        services.create_tasks(tenant, [{"name": "b", "image": "x"}] * 5)
    assert Task.objects.filter(tenant=tenant).count() == 6 == services.quota_use(tenant)["tasks"]
    services.create_tasks(tenant, [{"name": "c", "image": "x"}] * 4)
    assert services.quota_use(tenant) == scanned(tenant) == {"tasks": 10, "gpus": 10, "gpu_memory_mb": 0}


def test_a_tenant_without_a_counter_row_starts_from_zero(world):
    tenant = world.tenants["beta"]
    TenantUsage.objects.filter(tenant=tenant).delete()
    assert services.quota_use(tenant) == {"tasks": 0, "gpus": 0, "gpu_memory_mb": 0}
    services.create_task(tenant=tenant, name="first", image="x", gpu_required=2)
    assert services.quota_use(tenant) == scanned(tenant) == {"tasks": 1, "gpus": 2, "gpu_memory_mb": 0}
