"""Factories for the rows tests start from: users, nodes with their GPUs, tasks in any
status on a node, task groups with their members (gang, or an inference service's
replicas), alerts. They write rows as they are, past the services, so a test can start
from any state; a test of a service's own writes calls the service."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import factory
from django.contrib.auth import get_user_model

from apps.alerts.choices import AlertType, Severity
from apps.alerts.models import Alert
from apps.core.clock import utcnow
from apps.core.principals import Principal, PrincipalKind
from apps.nodes.choices import NodeStatus
from apps.nodes.models import Gpu, Node
from apps.scheduler.models import GpuAllocation
from apps.slices import ledger
from apps.slices.models import Slice, SliceRequest
from apps.tasks.models import Task, TaskGroup
from apps.tenants import services
from apps.tenants.choices import Role


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.test")
    password = factory.django.Password("pw-for-tests-only")


class OperatorFactory(UserFactory):
    username = factory.Sequence(lambda n: f"operator{n}")
    is_staff = True
    is_superuser = True


class TaskFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Task

    name = factory.Sequence(lambda n: f"task-{n}")


def make_node(
    node_id: str,
    gpus: int = 8,
    *,
    vendor: str = "nvidia",
    model: str = "H100",
    memory_total_mb: int | None = 81920,
    **fields,
) -> Node:
    """A node that beat just now (online unless `status` says otherwise) with `gpus` cards,
    indices 0…gpus-1, and its GPU summary (count, type) as the heartbeat leaves it.
    `fields` are the node's other columns."""
    fields = {
        "name": node_id,
        "status": NodeStatus.ONLINE,
        "last_heartbeat_at": utcnow(),
        "gpu_count": gpus,
        "gpu_type": vendor if gpus else "",
        **fields,
    }
    node = Node.objects.create(id=node_id, **fields)
    Gpu.objects.bulk_create(
        Gpu(node=node, index=i, vendor=vendor, model=model, memory_total_mb=memory_total_mb) for i in range(gpus)
    )
    return node


def make_task(tenant, **fields) -> Task:
    """A task of `tenant` written as it is, in any status and on any node (`status=`,
    `node=`), without the scheduler; name "t" and image "x" unless given."""
    return TaskFactory(tenant=tenant, **{"name": "t", "image": "x", **fields})


def make_group(
    tenant, workers: int = 2, gpus: int = 8, *, gpu_type: str = "nvidia", members=None, **fields
) -> TaskGroup:
    """A task group of `tenant` with its `workers` member tasks (ranks 0…workers-1, of the
    group's kind, `gpus` cards each, pending and of the group's priority), as a submission
    leaves it; `fields` are the group's other columns (world_size: `workers`, at least 1),
    `members` more columns of each member: a dict, or a function of the rank giving one."""
    fields.setdefault("world_size", max(workers, 1))
    group = TaskGroup.objects.create(
        tenant=tenant,
        name=fields.pop("name", "g"),
        gpus_per_worker=gpus,
        gpu_type=gpu_type,
        image=fields.pop("image", "x"),
        **fields,
    )
    extra = members if callable(members) else (lambda rank: members or {})
    Task.objects.bulk_create(
        Task(
            tenant=tenant,
            name=f"{group.name}-{rank}",
            image=group.image,
            kind="inference" if group.kind == "inference" else "training",
            group=group,
            rank=rank,
            gpu_required=gpus,
            gpu_type=gpu_type,
            priority=group.priority,
            **extra(rank),
        )
        for rank in range(workers)
    )
    return group


def make_replica_group(
    tenant, replicas: int = 2, gpus: int = 1, *, gpu_type: str = "nvidia", serving: dict | None = None, **fields
) -> TaskGroup:
    """An inference service's group as the service leaves it: kind inference, placement
    replicas, with `replicas` pending member tasks (ranks 0…replicas-1, kind inference,
    `gpus` cards each, `serving` as given); `fields` are the group's other columns."""
    return make_group(
        tenant,
        replicas,
        gpus,
        gpu_type=gpu_type,
        kind="inference",
        placement="replicas",
        name=fields.pop("name", "svc"),
        members={"serving": serving or {}, "health_probe": {"path": "/v1/models"}},
        **fields,
    )


def make_alert(**fields) -> Alert:
    """An alert row as it is (no notification, no dedup): ACTIVE unless `state` says
    otherwise; `type`, `severity`, `key`, `message` have placeholders."""
    return Alert.objects.create(
        **{"type": AlertType.GPU_LOST, "severity": Severity.WARNING, "key": "k", "message": "m", **fields}
    )


def make_task_holding(node: Node, tenant, status: str, card: int = 0) -> Task:
    """A task in `status` on `node` holding card `card` in the scheduler's ledger, as a
    bind leaves it (named after its status)."""
    task = make_task(tenant, name=status, status=status, node=node)
    GpuAllocation.objects.create(task=task, node=node, gpu_index=card, tenant=tenant)
    return task


def make_slice(node: Node, tenant=None, task: Task | None = None, **fields) -> Slice:
    """A slice written as it is (any state, tier, card): a 1g.18gb MIG slice of 18 GB on
    card 0, requested, unless `fields` say otherwise."""
    fields = {
        "gpu_index": 0,
        "gpu_uuid": f"GPU-{node.pk}-{fields.get('gpu_index', 0)}",
        "tier": "mig",
        "memory_mb": 18 * 1024,
        "compute_percent": 14,
        "profile": "1g.18gb",
        **fields,
    }
    return Slice.objects.create(node=node, tenant=tenant or (task.tenant if task else None), task=task, **fields)


def make_slice_request(slice_: Slice, action: str = "create", **fields) -> SliceRequest:
    """A request for `slice_`'s agent as ledger.issue writes it (pending unless `status`
    says otherwise); `fields` are its other columns."""
    fields.setdefault("vendor", {"mig": "nvidia-mig", "mps": "nvidia-mps", "hami": "hygon-hami"}[slice_.tier])
    fields.setdefault("params", ledger.request_params(slice_))
    return SliceRequest.objects.create(node_id=slice_.node_id, slice=slice_, action=action, **fields)


def make_bound_slice(node: Node, tenant, *, card: int = 0, state: str = "requested", **fields) -> Slice:
    """A memory-only task as a bind leaves it: scheduled on `node`, its card held in the
    ledger for the slice's memory, the slice in `state` and, for a hardware tier
    requested or issued, its create request (pending; processing when issued).
    `fields` are the slice's other columns (tier, memory_mb, profile…)."""
    memory = fields.get("memory_mb", 18 * 1024)
    task = make_task(tenant, name=f"sliced-{state}", status="scheduled", node=node, gpu_memory_mb=memory)
    GpuAllocation.objects.create(task=task, node=node, gpu_index=card, tenant=tenant, memory_mb=memory)
    slice_ = make_slice(node, task=task, gpu_index=card, state=state, **fields)
    if slice_.tier != "software" and state in ("requested", "issued"):
        now = utcnow()
        extra = {"status": "processing", "claimed_at": now, "deadline": now + timedelta(seconds=120)}
        make_slice_request(slice_, "create", **(extra if state == "issued" else {}))
    return slice_


@dataclass
class World:
    """Two tenants with an admin, a member and a viewer each, an operator, and keys."""

    operator: object = None
    operator_key: str = ""
    tenants: dict = field(default_factory=dict)
    users: dict = field(default_factory=dict)  # "acme-admin" -> user
    keys: dict = field(default_factory=dict)  # "acme-admin" -> plaintext key


def build_world() -> World:
    world = World()
    world.operator = OperatorFactory(username="op")
    world.operator_key = services.issue_platform_key(user=world.operator, name="ops").key
    for slug in ("acme", "beta"):
        tenant = services.create_tenant(name=slug.capitalize(), slug=slug)
        world.tenants[slug] = tenant
        for role in (Role.ADMIN, Role.MEMBER, Role.VIEWER):
            label = f"{slug}-{role}"
            user = UserFactory(username=label)
            services.add_member(tenant, username=user.username, role=role)
            world.users[label] = user
            owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=role)
            world.keys[label] = services.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name=label).key
    return world
