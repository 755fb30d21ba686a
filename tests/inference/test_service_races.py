"""Scales of one service at the same moment, on real connections: of two scales read from
the same count exactly one wins, and the replica tasks always match the count that won."""

import pytest

from apps.inference import services
from apps.inference.models import InferenceService, Model
from apps.tasks.choices import TERMINAL
from apps.tasks.models import Task, TaskGroup
from apps.tenants import services as tenant_services
from tests.concurrency import together
from tests.inference.services_helpers import OPERATOR, body

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def tenant():
    tenant = tenant_services.create_tenant(name="Scale Race", slug="scale-race")
    Model.objects.create(tenant=tenant, name="qwen3-8b", source_kind="hub", source="Qwen/Qwen3-8B", format="gguf")
    yield tenant
    TaskGroup.objects.filter(tenant=tenant).delete()
    Model.objects.filter(tenant=tenant).delete()
    tenant_services.delete_tenant(tenant)


@pytest.mark.parametrize("targets", [(4, 1), (4, 3), (1, 3)])
def test_two_scales_from_one_count_one_wins_and_the_replicas_match_it(tenant, targets):
    service = services.create_service(OPERATOR, body(tenant=tenant.slug, min_replicas=2, max_replicas=4))
    reads = [InferenceService.objects.get(pk=service.pk) for _ in targets]

    def scale(i):
        won = services.scale_service(reads[i], targets[i], source="window", reason=f"racer {i}")
        return (targets[i], won)

    outcomes = together(2, scale)
    winners = [target for target, won in outcomes if won]
    assert len(winners) == 1, outcomes
    now = InferenceService.objects.get(pk=service.pk).replicas
    assert now == winners[0]
    live = Task.objects.filter(group_id=service.pk).exclude(status__in=TERMINAL)
    assert sorted(live.values_list("rank", flat=True)) == list(range(now))
