"""The slices page and the node detail's per-GPU slices, with Django's test client:
operators see every carved card, a tenant the cards its slices are on, another tenant's
slice there only as carved memory (no tenant, no task)."""

from __future__ import annotations

import pytest

from tests.factories import make_bound_slice, make_slice
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db


@pytest.fixture
def carved(world, cluster):
    node = cluster.nodes["shared"]  # 4 × H100 (81,559 MiB)
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    return {
        "acme": make_bound_slice(
            node, acme, state="confirmed", device_id="MIG-acme-1", memory_mb=20 * 1024, profile="1g.20gb"
        ),
        "beta": make_bound_slice(node, beta, state="issued", profile="2g.20gb", memory_mb=20 * 1024),
        "beta_alone": make_bound_slice(
            cluster.nodes["idle"], beta, card=1, state="confirmed", tier="software", profile="", memory_mb=8192
        ),
        "orphan": make_slice(node, None, gpu_index=2, state="orphaned", device_id="MIG-lost"),
        "ended": make_slice(node, acme, gpu_index=2, state="released"),
    }


def cards_on(html: str) -> list[str]:
    return [part.split('"')[0] for part in html.split('data-card="')[1:]]


def test_an_operator_sees_every_carved_card_with_its_bar_and_slices(client, world, carved):
    html = page(signed_in(client, world.operator), "/portal/slices/")
    assert cards_on(html) == ["shared-1/0", "shared-1/2", "shared-2/1"]
    card0 = html.split('data-card="shared-1/0"')[1].split('data-card="')[0]
    assert card0.count('class="slice-seg') == 2 and "40.0 GiB of 79.6 GiB carved" in card0
    assert "acme" in card0 and "beta" in card0 and f"#{carved['acme'].task_id}" in card0
    assert "gold" in card0 and "confirmed" in card0 and "issued" in card0
    assert "no tenant (found on the card)" in html
    assert "accounting only, not isolation" in html  # the software slice says what it is
    assert f'data-slice-row="{carved["ended"].pk}"' in html  # the table lists ended ones too
    assert 'aria-current="page">Slices</a>' in html


def test_a_tenant_sees_its_cards_and_others_slices_there_only_as_memory(client, world, carved):
    html = page(signed_in(client, world.users["acme-viewer"]), "/portal/slices/")
    assert cards_on(html) == ["shared-1/0"]
    card0 = html.split('data-card="shared-1/0"')[1]
    assert f"#{carved['acme'].task_id} sliced-confirmed" in card0
    assert "another tenant&#x27;s" in card0 or "another tenant's" in card0
    assert "beta" not in html.split("<main>")[1] and f"#{carved['beta'].task_id} " not in html
    assert f'data-slice-row="{carved["acme"].pk}"' in html and f'data-slice-row="{carved["beta"].pk}"' not in html
    assert "MIG-lost" not in html


def test_the_filters_narrow_the_table(client, world, carved):
    operator = signed_in(client, world.operator)
    html = page(operator, "/portal/slices/?state=orphaned")
    assert html.count("data-slice-row=") == 1 and f'data-slice-row="{carved["orphan"].pk}"' in html
    html = page(operator, "/portal/slices/?tier=software&node=shared-2")
    assert html.count("data-slice-row=") == 1 and cards_on(html) == ["shared-2/1"]
    assert page(operator, "/portal/slices/?state=melted").count("data-slice-row=") == 5  # unknown: ignored


def test_the_node_detail_shows_each_cards_slices(client, world, carved):
    html = page(signed_in(client, world.users["beta-member"]), "/portal/nodes/shared-1/")
    row = html.split('data-gpu-slices="0"')[1].split("</tr>")[0]
    assert row.count('class="slice-seg') == 2
    assert f"#{carved['beta'].task_id} sliced-issued" in row and "another tenant" in row
    assert "acme" not in row and "MIG-acme-1" not in row
    assert 'data-gpu-slices="1"' not in html  # a card with no slices has no slice row
    operator = page(signed_in(client, world.operator), "/portal/nodes/shared-1/")
    assert "no tenant (found on the card)" in operator.split('data-gpu-slices="2"')[1].split("</tr>")[0]


def test_the_admin_lists_slices_and_requests_read_only(client, world, carved):
    operator = signed_in(client, world.operator)
    html = page(operator, "/admin/slices/slice/?state__exact=confirmed")
    assert "MIG-acme-1" in html and "MIG-lost" not in html
    detail = page(operator, f"/admin/slices/slice/{carved['beta'].pk}/change/")
    assert "2g.20gb" in detail and "create" in detail  # its create request inline
    assert 'name="_save"' not in detail  # nothing to change
    page(operator, "/admin/slices/slicerequest/?status__exact=processing")
    assert client.get("/admin/slices/slice/add/").status_code == 403
    assert client.get(f"/admin/slices/slice/{carved['orphan'].pk}/delete/").status_code == 403
