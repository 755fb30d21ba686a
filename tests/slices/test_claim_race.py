"""Two agents' connections racing the claim of one slice request: the CAS lets one win.
(Apart from the module-scoped world fixture, whose open transaction would hide rows.)"""

from __future__ import annotations

import pytest
from django.db import connection

from apps.slices import services
from apps.slices.models import Slice, SliceRequest
from apps.tasks.models import Task
from apps.tenants import services as tenant_services
from tests.concurrency import together
from tests.factories import make_bound_slice, make_node


@pytest.mark.django_db(transaction=True)
def test_two_connections_racing_a_claim_have_one_winner():
    tenant = tenant_services.create_tenant(name="Race", slug="race-slices")
    try:
        node = make_node("race-node", 1)
        slice_ = make_bound_slice(node, tenant)
        request = slice_.requests.get()

        def claim(_):
            try:
                services.claim(SliceRequest.objects.get(pk=request.pk))
                return "won"
            except services.NotProcessing:
                return "lost"
            finally:
                connection.close()

        assert sorted(together(4, claim)) == ["lost", "lost", "lost", "won"]
        slice_.refresh_from_db()
        assert slice_.state == "issued"
    finally:
        SliceRequest.objects.all().delete()
        Slice.objects.all().delete()
        Task.objects.all().delete()
        tenant_services.delete_tenant(tenant)
