"""The energy pages (docs/energy.md): the node monitor's energy and carbon section and
the tenant's energy page; "—" for no data, never 0; carbon under the role rule."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.nodes.models import EmissionFactor, Gpu, Node
from apps.tasks.models import UsageRecord
from tests.factories import make_task
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db


def section(html):
    return re.search(r'<section class="card energy".*?</section>', html, re.S).group(0)


def meter(node_id, wh):
    now = utcnow()
    Gpu.objects.filter(node_id=node_id).update(energy_wh=wh, energy_since=now - timedelta(days=1), power_at=now)


def test_a_node_that_never_measured_shows_dashes_not_zeros(client, world, cluster):
    html = section(page(signed_in(client, world.operator), "/portal/nodes/monitor/?node=shared-2"))
    assert 'data-energy="lifetime">—<' in html and 'data-energy="kwh">—<' in html
    assert 'data-energy="cpu-lifetime">—<' in html and "no power measured yet" in html
    assert 'data-carbon="lifetime">—<' in html and 'data-basis="no_factor"' in html
    assert "0.000 kWh" not in html and " 0 g" not in html
    # the operator is told how to configure a factor, with the admin's page
    assert 'data-carbon="configure"' in html and "/admin/nodes/emissionfactor/" in html
    assert "CPU power (W, estimate)" in html and 'id="chart-power-cards"' in html


def test_the_section_shows_the_accumulators_and_carbon_by_role(client, world, cluster):
    meter("shared-1", 1_500.0)  # 4 cards × 1.5 kWh
    Node.objects.filter(pk="shared-1").update(region="eu-north", cpu_tdp_w=300.0)
    EmissionFactor.objects.create(region="eu-north", g_co2e_per_kwh=400.0)
    operator = section(page(signed_in(client, world.operator), "/portal/nodes/monitor/?node=shared-1"))
    assert 'data-energy="lifetime">6.000 kWh<' in operator
    assert 'data-carbon="lifetime">2.4 kg CO₂e<' in operator and "factor 400 g/kWh (region)" in operator
    assert 'data-carbon="configure"' not in operator
    assert "TDP 300 W (set by an operator)" in operator
    assert operator.count('<tr data-card="') == 4 and "GPU 3 (lost)" in operator
    client.logout()
    for label in ("acme-admin", "acme-member"):  # a shared node's carbon: operators only
        seen = section(page(signed_in(client, world.users[label]), "/portal/nodes/monitor/?node=shared-1"))
        assert 'data-energy="lifetime">6.000 kWh<' in seen
        assert 'data-carbon="lifetime">—<' in seen and 'data-basis="not_visible"' in seen
        assert "400 g/kWh" not in seen and 'data-carbon="configure"' not in seen
        client.logout()
    # beta's admin sees its dedicated node's carbon; its viewer does not
    meter("beta-1", 1_000.0)
    Node.objects.filter(pk="beta-1").update(emission_factor_g_per_kwh=100.0)
    admin = section(page(signed_in(client, world.users["beta-admin"]), "/portal/nodes/monitor/?node=beta-1"))
    assert 'data-carbon="lifetime">200 g CO₂e<' in admin and "(node)" in admin
    client.logout()
    viewer = section(page(signed_in(client, world.users["beta-viewer"]), "/portal/nodes/monitor/?node=beta-1"))
    assert 'data-carbon="lifetime">—<' in viewer and "the tenant's admins" in viewer


def test_the_monitor_hands_the_power_series_to_its_script(client, world, cluster):
    html = page(signed_in(client, world.users["acme-member"]), "/portal/nodes/monitor/?node=shared-2&hours=6")
    data = json.loads(re.search(r'<script id="monitor-data" type="application/json">(.*?)</script>', html, re.S)[1])
    assert data["energy_series"]["cpu_estimate"] is True and data["energy_series"]["bucket_seconds"] == 60


def test_the_energy_page_shows_a_tenants_tasks_with_carbon_by_the_rule(client, world, cluster):
    acme = world.tenants["acme"]
    done = make_task(acme, name="trained", status="completed")
    UsageRecord.objects.create(
        task=done,
        tenant=acme,
        gpus=1,
        gpu_seconds=7200.0,
        energy_wh=2_000.0,
        carbon_g=600.0,
        energy_wh_unfactored=500.0,
        ended_status="completed",
        settled_at=utcnow(),
    )
    dark = make_task(acme, name="dark", status="completed")
    UsageRecord.objects.create(
        task=dark, tenant=acme, gpus=1, gpu_seconds=3600.0, ended_status="completed", settled_at=utcnow()
    )
    member = page(signed_in(client, world.users["acme-member"]), "/portal/energy/")
    assert 'data-usage="gpu-hours">3.0<' in member and 'data-usage="energy">2.000 kWh<' in member
    assert 'data-usage="carbon" data-basis="partial">600 g CO₂e<' in member
    assert "0.500 kWh used where no emission factor is configured" in member
    assert f'<tr data-task="{done.pk}">' in member and f'<tr data-task="{dark.pk}">' not in member
    assert 'id="tenant"' not in member and 'data-usage="configure"' not in member
    client.logout()
    beta = page(signed_in(client, world.users["beta-admin"]), "/portal/energy/?tenant=acme")  # its own, still
    assert 'data-usage="energy">—<' in beta and 'data-usage="carbon" data-basis="no_data">—<' in beta
    assert "trained" not in beta
    client.logout()
    operator = page(signed_in(client, world.operator), "/portal/energy/?tenant=acme&days=7")
    assert 'data-days="7" aria-current="true"' in operator and '<option value="acme" selected>' in operator
    assert 'data-usage="energy">2.000 kWh<' in operator
    assert page(client, "/portal/energy/?tenant=nope", status=404)
