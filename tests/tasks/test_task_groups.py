"""Task groups: the status is derived from the members' statuses, never stored."""

import pytest
from django.db import IntegrityError, transaction

from apps.tasks.choices import GroupStatus as G
from apps.tasks.choices import group_status
from apps.tasks.models import TaskGroup
from tests.factories import make_task


@pytest.mark.parametrize(
    "members, expected",
    [
        ([], G.PENDING),
        (["pending", "pending"], G.PENDING),
        (["scheduled", "pending"], G.SCHEDULED),
        (["scheduled", "running"], G.SCHEDULED),
        (["starting", "running"], G.SCHEDULED),
        (["running", "running"], G.RUNNING),
        (["completed", "running"], G.RUNNING),  # rank 0 may finish first
        (["completed", "completed"], G.COMPLETED),
        (["failed", "running"], G.STOPPING),  # a lost worker ends the attempt
        (["stopping", "running"], G.STOPPING),
        (["preempting", "running"], G.STOPPING),
        (["stopped", "pending"], G.STOPPING),
        (["stopped", "stopped"], G.STOPPED),
        (["cancelled", "cancelled"], G.STOPPED),
        (["stopped", "completed"], G.STOPPED),
        (["failed", "stopped"], G.FAILED),
        (["failed", "completed"], G.FAILED),
    ],
)
def test_status_is_a_function_of_the_members(members, expected):
    assert group_status(members) == expected
    assert group_status(members, "gang") == expected


@pytest.mark.parametrize(
    "members, expected",
    [
        ([], G.PENDING),
        (["pending", "pending"], G.PENDING),
        (["running", "pending"], G.RUNNING),  # one serves while the other is rebuilt
        (["running", "failed"], G.RUNNING),  # a dead replica does not stop the service
        (["running", "stopped"], G.RUNNING),  # a slot stopped by a scale-down
        (["running", "stopping"], G.RUNNING),
        (["scheduled", "pending"], G.SCHEDULED),
        (["starting", "failed"], G.SCHEDULED),
        (["waking", "stopped"], G.SCHEDULED),
        (["pending", "failed"], G.PENDING),  # the dead one requeued, waiting for placement
        (["pending", "stopping"], G.PENDING),
        (["stopping", "failed"], G.STOPPING),
        (["preempting", "stopping"], G.STOPPING),
        (["failed", "failed"], G.FAILED),
        (["stopped", "stopped"], G.STOPPED),
        (["stopped", "failed"], G.FAILED),  # every member ended: as a gang's
    ],
)
def test_a_replicas_groups_status_follows_its_current_replicas(members, expected):
    assert group_status(members, "replicas") == expected


@pytest.mark.django_db
def test_status_follows_the_member_rows(world):
    acme = world.tenants["acme"]
    group = TaskGroup.objects.create(
        tenant=acme, name="llm", world_size=2, gpus_per_worker=4, gpu_type="nvidia", strategy="ddp"
    )
    assert group.status == G.PENDING
    first = make_task(acme, group=group, rank=0, kind="training", gpu_required=4)
    make_task(acme, group=group, rank=1, kind="training", gpu_required=4, status="running")
    assert group.status == G.SCHEDULED
    assert TaskGroup.objects.with_status().get(pk=group.pk).status == G.SCHEDULED
    first.status = "running"
    first.save()
    assert TaskGroup.objects.with_status().get(pk=group.pk).status == G.RUNNING
    empty = TaskGroup.objects.create(tenant=acme, name="e", world_size=1, gpu_type="nvidia")
    assert TaskGroup.objects.with_status().get(pk=empty.pk).status == G.PENDING
    assert "status" not in {f.name for f in TaskGroup._meta.concrete_fields}


@pytest.mark.django_db
def test_a_rank_is_taken_once_per_group(world):
    acme = world.tenants["acme"]
    group = TaskGroup.objects.create(tenant=acme, name="g", world_size=2, gpu_type="nvidia")
    make_task(acme, group=group, rank=0)
    with pytest.raises(IntegrityError), transaction.atomic():
        make_task(acme, group=group, rank=0)
    with pytest.raises(IntegrityError), transaction.atomic():
        make_task(acme, group=group)  # a member without a rank
