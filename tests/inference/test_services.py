"""The inference services' state changes: a service created whole or not at all against
the quota, another tenant's service and model unknown, the count's CAS (a stale count
loses and changes nothing), the replicas following a scale, the state machine's moves and
their effects on the replica tasks, illegal moves refused."""

import pytest
from django.http import Http404
from rest_framework.exceptions import PermissionDenied, ValidationError

from apps.alerts.models import Alert
from apps.core.errors import Conflict
from apps.inference import selectors, services
from apps.inference.models import InferenceService, ServiceDecision
from apps.inference.sleep import Event
from apps.tasks.choices import TaskStatus as S
from apps.tasks.models import Task, TaskEvent, TaskGroup
from apps.tenants.choices import Role
from tests.factories import make_node
from tests.inference.services_helpers import OPERATOR, body, make_model, make_service, member, set_quota

pytestmark = pytest.mark.django_db


def replicas(service) -> list[tuple[int, str]]:
    return list(Task.objects.filter(group_id=service.pk).order_by("rank").values_list("rank", "status"))


def test_a_member_creates_a_service_with_its_group_replicas_and_decision(world):
    make_model(world.tenants["acme"])
    service = services.create_service(member(world), body(health_probe=None, engine="vllm", env={"A": "1"}))
    group = TaskGroup.objects.get(pk=service.pk)
    assert (group.kind, group.placement, group.gpus_per_worker, group.gpu_type, group.image) == (
        "inference",
        "replicas",
        2,
        "nvidia",
        "auto",
    )
    assert group.tenant == world.tenants["acme"] and group.created_by == world.users["acme-member"]
    service = InferenceService.objects.get(pk=service.pk)
    assert (service.state, service.replicas, service.min_replicas, service.max_replicas) == ("starting", 2, 2, 4)
    tasks = list(Task.objects.filter(group=group).order_by("rank"))
    assert [(t.rank, t.kind, t.status, t.gpu_required, t.name) for t in tasks] == [
        (0, "inference", "pending", 2, "chat-0"),
        (1, "inference", "pending", 2, "chat-1"),
    ]
    assert tasks[0].health_probe == {"path": "/v1/models"} and tasks[0].env == {"A": "1"}
    assert tasks[0].serving == {
        "engine": "vllm",
        "model": "qwen3-8b",
        "format": "safetensors",
        "source_kind": "path",
        "source": "/models/qwen3-8b",
        "args": ["--max-model-len", "4096"],
    }
    decision = ServiceDecision.objects.get(service=service)
    assert (decision.source, decision.action, decision.to_replicas) == ("user", "create", 2)


def test_a_service_over_the_quota_is_refused_whole_and_writes_nothing(world):
    make_model(world.tenants["acme"])
    set_quota(world, max_gpus=3)  # 2 replicas × 2 GPUs = 4
    before = (TaskGroup.objects.count(), Task.objects.count(), InferenceService.objects.count())
    with pytest.raises(Conflict) as refused:
        services.create_service(member(world), body())
    assert refused.value.get_codes() == "quota_exceeded"
    assert "0 of 3 GPUs in use, 4 more asked" in str(refused.value.detail)
    assert (TaskGroup.objects.count(), Task.objects.count(), InferenceService.objects.count()) == before
    assert not ServiceDecision.objects.exists()
    # the refusal is an alert for the tenant, as a refused task's is
    assert Alert.objects.filter(type="QUOTA_EXCEEDED", tenant=world.tenants["acme"], state="ACTIVE").exists()


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"model": "nope"}, "model"),
        ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"autoscaling": {"target_in_flight": -1}}, "autoscaling"),
        ({"autoscaling": {"surprise": 1}}, "autoscaling"),
        ({"window": {"days": ["mon"], "ranges": [], "timezone": "UTC", "action": "pause"}}, "window"),
        ({"sleep_after_seconds": 5}, "sleep_after_seconds"),
    ],
)
def test_a_refused_body_writes_nothing(world, fields, field):
    make_model(world.tenants["acme"])
    with pytest.raises(ValidationError) as refused:
        services.create_service(member(world), body(**fields))
    assert field in refused.value.detail
    assert not TaskGroup.objects.exists() and not Task.objects.exists()


def test_another_tenants_model_and_tenant_are_unknown(world):
    make_model(world.tenants["beta"], "beta-only")
    with pytest.raises(ValidationError) as refused:
        services.create_service(member(world), body(model="beta-only"))
    assert "model" in refused.value.detail
    with pytest.raises(Http404):
        services.create_service(member(world), body(tenant="beta", model="beta-only"))
    with pytest.raises(PermissionDenied):
        services.create_service(member(world, role=Role.VIEWER), body())
    assert not TaskGroup.objects.exists()


def test_an_operator_names_the_tenant(world):
    make_model(world.tenants["beta"])
    with pytest.raises(ValidationError):
        services.create_service(OPERATOR, body())
    service = services.create_service(OPERATOR, body(tenant="beta", min_replicas=1))
    assert service.group.tenant == world.tenants["beta"] and replicas(service) == [(0, "pending")]


def test_stop_and_wake_of_another_tenants_service_are_404(world):
    service = make_service(world)
    for action in (services.stop_service, services.wake_service):
        with pytest.raises(Http404):
            action(member(world, "beta"), service)
        with pytest.raises(PermissionDenied):
            action(member(world, role=Role.VIEWER), service)
    assert InferenceService.objects.get(pk=service.pk).state == "starting"


def test_scale_up_creates_new_ranks_and_down_stops_the_highest_first(world):
    service = make_service(world)
    assert services.scale_service(service, 4, source="user", reason="more")
    assert replicas(service) == [(0, "pending"), (1, "pending"), (2, "pending"), (3, "pending")]
    assert services.scale_service(service, 2, source="user", reason="less")
    assert replicas(service) == [(0, "pending"), (1, "pending"), (2, "cancelled"), (3, "cancelled")]
    ids = dict(Task.objects.filter(group_id=service.pk).values_list("rank", "pk"))
    # back up: the stopped slots are requeued (the same task rows), no new rank
    assert services.scale_service(service, 3, source="user", reason="again")
    assert replicas(service) == [(0, "pending"), (1, "pending"), (2, "pending"), (3, "cancelled")]
    assert dict(Task.objects.filter(group_id=service.pk).values_list("rank", "pk")) == ids
    assert TaskEvent.objects.filter(task_id=ids[2], kind="replica_requeued").exists()
    saved = InferenceService.objects.get(pk=service.pk)
    assert (saved.replicas, saved.last_scale_direction) == (3, "up") and saved.last_scaled_at is not None
    actions = list(ServiceDecision.objects.filter(service=service).order_by("id").values_list("action", "to_replicas"))
    assert actions == [("create", 2), ("scale_up", 4), ("scale_down", 2), ("scale_up", 3)]


def test_a_stale_count_loses_the_cas_and_changes_nothing(world):
    service = make_service(world)
    first, second = (InferenceService.objects.get(pk=service.pk) for _ in range(2))
    assert services.scale_service(first, 3, source="autoscaler", reason="load")
    assert not services.scale_service(second, 4, source="user", reason="me too")
    assert InferenceService.objects.get(pk=service.pk).replicas == 3
    assert len(replicas(service)) == 3
    assert ServiceDecision.objects.filter(service=service, action__startswith="scale").count() == 1


def test_a_user_scale_outside_the_bounds_is_refused(world):
    service = make_service(world)
    for count in (1, 5):
        with pytest.raises(ValidationError):
            services.scale_service(service, count, source="user", reason="x")
    assert InferenceService.objects.get(pk=service.pk).replicas == 2 and len(replicas(service)) == 2


def test_a_scale_up_over_the_quota_is_refused_and_changes_nothing(world):
    service = make_service(world)
    set_quota(world, max_gpus=5)
    with pytest.raises(Conflict) as refused:
        services.scale_service(service, 3, source="user", reason="more")
    assert refused.value.get_codes() == "quota_exceeded"
    assert InferenceService.objects.get(pk=service.pk).replicas == 2 and len(replicas(service)) == 2


def test_sleep_stops_the_replicas_and_wake_requeues_the_same_slots(world):
    service = make_service(world)
    InferenceService.objects.filter(pk=service.pk).update(state="running")
    service.refresh_from_db()
    node = make_node("svc-1", 4)
    Task.objects.filter(group_id=service.pk, rank=0).update(status=S.RUNNING, node=node, host_port=8001)
    assert services.move_service(service, Event.IDLE, source="sleep", reason="idle 600 s")
    assert InferenceService.objects.get(pk=service.pk).state == "sleeping"
    assert replicas(service) == [(0, "stopping"), (1, "cancelled")]
    Task.objects.filter(group_id=service.pk, rank=0).update(status=S.STOPPED)  # the agent's confirmation
    woken = services.wake_service(member(world), InferenceService.objects.get(pk=service.pk))
    assert woken.state == "waking"
    assert replicas(service) == [(0, "pending"), (1, "pending")]
    rank0 = Task.objects.get(group_id=service.pk, rank=0)
    assert rank0.node_id is None and rank0.host_port is None and rank0.finished_at is None
    # a second wake while it wakes changes nothing and records nothing
    count = ServiceDecision.objects.count()
    assert services.wake_service(member(world), woken).state == "waking"
    assert ServiceDecision.objects.count() == count


@pytest.mark.parametrize(
    "state,event",
    [("sleeping", Event.PAUSE), ("paused", Event.WAKE), ("stopped", Event.WAKE), ("starting", Event.IDLE)],
)
def test_an_illegal_move_is_a_conflict_and_changes_nothing(world, state, event):
    service = make_service(world)
    InferenceService.objects.filter(pk=service.pk).update(state=state)
    service.refresh_from_db()
    with pytest.raises(Conflict) as refused:
        services.move_service(service, event, source="user", reason="x")
    assert refused.value.get_codes() == "invalid_state"
    assert InferenceService.objects.get(pk=service.pk).state == state
    assert replicas(service) == [(0, "pending"), (1, "pending")]


def test_a_stale_state_loses_the_cas(world):
    service = make_service(world)
    stale = InferenceService.objects.get(pk=service.pk)
    assert services.move_service(service, Event.HEALTHY, source="rebuild", reason="a replica is healthy")
    assert not services.move_service(stale, Event.PAUSE, source="window", reason="outside")
    assert InferenceService.objects.get(pk=service.pk).state == "running"
    assert replicas(service) == [(0, "pending"), (1, "pending")]


def test_stop_service_stops_every_replica_and_asking_again_is_fine(world):
    service = make_service(world)
    stopped = services.stop_service(member(world), service)
    assert stopped.state == "stopping"
    assert replicas(service) == [(0, "cancelled"), (1, "cancelled")]
    assert services.stop_service(member(world), stopped).state == "stopping"
    InferenceService.objects.filter(pk=service.pk).update(state="stopped")
    with pytest.raises(Conflict):
        services.stop_service(member(world), InferenceService.objects.get(pk=service.pk))
    with pytest.raises(Conflict):
        services.scale_service(InferenceService.objects.get(pk=service.pk), 3, source="user", reason="x")


def test_replicas_of_lists_node_port_health_and_address(world):
    service = make_service(world)
    node = make_node("svc-2", 4, ip="10.0.0.7")
    ids = dict(Task.objects.filter(group_id=service.pk).values_list("rank", "pk"))
    Task.objects.filter(pk=ids[0]).update(status=S.RUNNING, node=node, host_port=8003)
    Task.objects.filter(pk=ids[1]).update(status=S.STARTING, node=node, host_port=8004)
    node.task_health = [{"task_id": ids[0], "healthy": True}, {"task_id": ids[1], "healthy": True}]
    node.save()
    rows = selectors.replicas_of(service)
    assert [(r["rank"], r["status"], r["healthy"], r["address"], r["node_address"]) for r in rows] == [
        (0, "running", True, "http://10.0.0.7:8003", "10.0.0.7"),
        (1, "starting", False, "http://10.0.0.7:8004", "10.0.0.7"),
    ]
    node.task_health = []
    node.save()
    assert selectors.replicas_of(service)[0]["healthy"] is None
    assert selectors.node_address("fd00::1", 8000) == "http://[fd00::1]:8000"
