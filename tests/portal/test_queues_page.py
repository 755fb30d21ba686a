"""The Queues page (docs/queues.md): operators see every tenant's queue, a tenant's people
their own; a bar per GPU type with what is used within nominal, borrowed and lent; the
fair-share order of each cohort; a tenant without a queue said so."""

from __future__ import annotations

import re

import pytest
from django_tenants.utils import schema_context

from apps.confidential.models import AuditEvent
from apps.core.clock import utcnow
from apps.scheduler import quotas
from apps.scheduler.models import GpuAllocation
from apps.tenants.models import TenantQueue
from tests.factories import make_node, make_task
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db


def card(html, tenant):
    return re.search(rf'<section class="card" data-queue="{tenant}">.*?</section>', html, re.S).group(0)


@pytest.fixture
def lab(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    quotas.set_queue(acme, cohort="lab", weight=1.0, quotas=[quotas.QuotaInput("nvidia", 1)])
    quotas.set_queue(beta, cohort="lab", weight=2.0, quotas=[quotas.QuotaInput("nvidia", 3, borrowing_limit=2)])
    make_node("q1", 4)
    for index in (0, 1):  # acme: 1 within nominal, 1 borrowed from beta
        task = make_task(acme, name=f"r{index}", status="running", node_id="q1", gpu_required=1)
        GpuAllocation.objects.create(task=task, node_id="q1", gpu_index=index, tenant=acme)
    TenantQueue.objects.filter(tenant=acme).update(usage_above_nominal=2 * 3600.0, usage_at=utcnow())


def test_operators_see_every_tenants_bars_and_the_fair_share_order(client, world, lab):
    html = page(signed_in(client, world.operator), "/portal/queues/")
    acme = card(html, "acme")
    assert "data-used>2<" in acme and "data-borrowed>1<" in acme and "data-nominal>1<" in acme
    assert 'aria-label="1 used within nominal, 1 borrowed, 0 lent, 0 idle"' in acme
    beta = card(html, "beta")
    assert "data-lent>1<" in beta and "of 2" in beta  # its borrowing limit
    order = re.search(r'data-fair-order="lab">.*?</section>', html, re.S).group(0)
    assert order.index("beta") < order.index("acme")  # acme has borrowed lately: beta goes first
    assert "2.0 GPU-hours above nominal lately" in order
    assert "/admin/tenants/tenantqueue/" in html


def test_a_tenants_people_see_only_their_own(client, world, lab):
    html = page(signed_in(client, world.users["beta-viewer"]), "/portal/queues/")
    assert 'data-queue="beta"' in html and 'data-queue="acme"' not in html
    assert "/admin/" not in html.split("<h1>Queues</h1>", 1)[1]


def test_a_tenant_without_a_queue_is_said_not_limited(client, world):
    html = page(signed_in(client, world.users["acme-member"]), "/portal/queues/")
    assert "data-queue-none" in card(html, "acme") and "not limited by queues" in html


def test_the_admin_sets_a_queue_with_its_quotas_through_the_service(client, world):
    client.force_login(world.operator)
    form = {
        "tenant": world.tenants["beta"].pk,
        "weight": "2",
        "cohort_name": "lab",
        "quotas-TOTAL_FORMS": "1",
        "quotas-INITIAL_FORMS": "0",
        "quotas-MIN_NUM_FORMS": "0",
        "quotas-MAX_NUM_FORMS": "1000",
        "quotas-0-gpu_type": "nvidia",
        "quotas-0-nominal": "8",
        "quotas-0-borrowing_limit": "2",
        "quotas-0-lending_limit": "",
    }
    answer = client.post("/admin/tenants/tenantqueue/add/", form, follow=True)
    assert answer.status_code == 200
    queue = TenantQueue.objects.get(tenant=world.tenants["beta"])
    assert (queue.cohort.name, queue.weight) == ("lab", 2.0)
    assert list(queue.quotas.values_list("gpu_type", "nominal", "borrowing_limit", "lending_limit")) == [
        ("nvidia", 8, 2, None)
    ]
    with schema_context(world.tenants["beta"].schema_name):
        assert AuditEvent.objects.filter(action="queue.updated", target="beta").exists()
    assert "nominal nvidia cards add up to 8, more than the 0" in answer.content.decode()  # no nvidia card here
