"""The wake patrol and the AutoScaler at the same moment, on real connections: both give a
lent service its replicas back (the patrol: the loan's count; the AutoScaler: traffic),
both through scale_service's compare-and-set on the count they read, taking the service's
row before its tasks' (docs/architecture.md, lock order). Whoever goes first, the count
ends at the loan's, its replicas match it, nothing deadlocks, the training is preempted
once and the loan is returned (by a later round when the patrol lost)."""

import pytest

from apps.inference import lending, rounds, services
from apps.inference.models import InferenceService, Model, ServiceDecision, ServiceLoan
from apps.scheduler.cycle import run_cycle
from apps.tasks.choices import TERMINAL
from apps.tasks.models import Task, TaskGroup
from apps.tenants import services as tenant_services
from tests.concurrency import together
from tests.factories import make_node, make_task
from tests.inference.lending_support import confirm, in_flight, replicas_up, wipe_signals
from tests.inference.services_helpers import OPERATOR, body

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def tenant():
    wipe_signals()
    tenant = tenant_services.create_tenant(name="Lend Race", slug="lend-race")
    Model.objects.create(tenant=tenant, name="qwen3-8b", source_kind="hub", source="Qwen/Qwen3-8B", format="gguf")
    yield tenant
    wipe_signals()
    TaskGroup.objects.filter(tenant=tenant).delete()
    Task.objects.filter(tenant=tenant).delete()
    Model.objects.filter(tenant=tenant).delete()
    tenant_services.delete_tenant(tenant)


def lent_service(tenant):
    """A service of two one-card replicas on a two-card node, one lent to a running
    training, and traffic again (20 in flight: the AutoScaler wants its max, 2)."""
    make_node("race-n1", gpus=2)
    service = services.create_service(
        OPERATOR, body(tenant=tenant.slug, gpus_per_replica=1, min_replicas=1, max_replicas=2)
    )
    assert services.scale_service(service, 2, source="user", reason="two")
    run_cycle()
    replicas_up(service)
    InferenceService.objects.filter(pk=service.pk).update(state="running", last_scaled_at=None)
    in_flight(service, 0)
    train = make_task(tenant, name="train", kind="training", gpu_required=1, gpu_type="nvidia")
    assert train.pk in run_cycle().loans
    lent = Task.objects.get(group_id=service.pk, rank=1)
    confirm(lent.pk, "stopping", "stopped")
    assert run_cycle().bound == [train.pk]
    confirm(train.pk, "scheduled", "running")
    in_flight(service, 20)
    return service, train


@pytest.mark.parametrize("attempt", range(3))
def test_the_patrol_and_the_autoscaler_at_once_give_the_replicas_back_once(tenant, attempt):
    service, train = lent_service(tenant)

    def act(i):
        return rounds.autoscale_round() if i == 0 else lending.patrol_round()

    together(2, act)
    lending.patrol_round()  # a patrol that lost the count's CAS finishes on its next round
    now = InferenceService.objects.get(pk=service.pk)
    assert now.replicas == 2
    live = Task.objects.filter(group_id=service.pk).exclude(status__in=TERMINAL)
    assert sorted(live.values_list("rank", flat=True)) == [0, 1]
    loan = ServiceLoan.objects.get(service_id=service.pk)
    assert loan.state == "returned" and "traffic" in loan.returned_why
    train.refresh_from_db()
    assert train.status == "preempting" and train.preempt_count == 0
    ups = ServiceDecision.objects.filter(service_id=service.pk, to_replicas=2, from_replicas=1).exclude(source="user")
    assert ups.count() == 1, list(ups.values_list("source", "action"))
