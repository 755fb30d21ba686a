"""Creates at the same moment against a quota with room for fewer: never more pass than
fit. Real threads, real connections, the tenant's usage row locked for the check."""

import pytest

from apps.core.errors import Conflict
from apps.tasks.models import Task, TaskGroup
from apps.tasks.services import create_group, create_task, create_tasks, quota_use
from apps.tenants import services
from tests.concurrency import together

pytestmark = pytest.mark.django_db(transaction=True)


def test_concurrent_creates_cannot_both_pass_a_quota_with_room_for_one():
    tenant = services.create_tenant(name="Quota Race", slug="quota-race", max_gpus=4)
    try:
        Task.objects.create(tenant=tenant, name="existing", gpu_required=2)

        def submit(i):
            try:
                create_task(tenant=tenant, name=f"t{i}", image="x", gpu_required=2)
                return "created"
            except Conflict:
                return "refused"

        outcomes = together(4, submit)
        assert sorted(outcomes) == ["created", "refused", "refused", "refused"]
        assert Task.objects.filter(tenant=tenant).count() == 2
    finally:
        Task.objects.filter(tenant=tenant).delete()
        services.delete_tenant(tenant)


def test_racing_creates_and_batches_through_the_counter_never_overrun_the_quota():
    """8 threads, each a mix of single creates and batches of 3, against room for 20
    tasks: a request fits whole or not at all, the quota is never passed, and the
    counter still equals a count of the rows."""
    tenant = services.create_tenant(name="Quota Crowd", slug="quota-crowd", max_concurrent_tasks=20, max_gpus=30)
    try:

        def submit(i):
            created = 0
            for k in range(6):
                size = 3 if (i + k) % 2 else 1
                try:
                    created += len(
                        create_tasks(tenant, [{"name": f"t{i}-{k}", "image": "x", "gpu_required": 1}] * size)
                    )
                except Conflict:
                    pass
            return created

        created = together(8, submit)
        rows = Task.objects.filter(tenant=tenant).count()
        assert rows == sum(created) <= 20
        # 96 tasks asked for room for 20: some request was refused, so the rest of the room
        # is less than a batch (a single is refused only when it is full)
        assert rows >= 18
        assert quota_use(tenant) == {"tasks": rows, "gpus": rows, "gpu_memory_mb": 0}
    finally:
        Task.objects.filter(tenant=tenant).delete()
        services.delete_tenant(tenant)


def test_two_groups_racing_for_room_for_one_leave_one_whole_group_and_nothing_of_the_other():
    """A group's members are counted against the quota at once, under the same lock: of
    two 2 × 4-GPU groups submitted together against room for 8 GPUs, one is created with
    both members and the other leaves neither its row nor a member."""
    tenant = services.create_tenant(name="Group Race", slug="group-race", max_gpus=8)
    try:

        def submit(i):
            try:
                group = create_group(
                    tenant, {"name": f"g{i}", "world_size": 2, "gpus_per_worker": 4, "gpu_type": "nvidia", "image": "x"}
                )
                return group.pk
            except Conflict:
                return "refused"

        outcomes = together(2, submit)
        (created,) = [outcome for outcome in outcomes if outcome != "refused"]
        assert outcomes.count("refused") == 1
        assert list(TaskGroup.objects.filter(tenant=tenant).values_list("pk", flat=True)) == [created]
        rows = sorted(Task.objects.filter(tenant=tenant).values_list("group_id", "rank"))
        assert rows == [(created, 0), (created, 1)]
        assert quota_use(tenant) == {"tasks": 2, "gpus": 8, "gpu_memory_mb": 0}
    finally:
        Task.objects.filter(tenant=tenant).delete()
        TaskGroup.objects.filter(tenant=tenant).delete()
        services.delete_tenant(tenant)
