"""The Slices page in a real browser (Chromium driven by Playwright against the control
plane under uvicorn, as tests/portal/browser/test_walkthrough.py does): a tenant member
opens Slices from the navigation, sees the card carved (a bar with one segment per slice,
its own slice with its task, another tenant's only as memory), filters the table, and
follows the card to the node detail's per-GPU slices. Each page is saved under
test-artefacts/screenshots/.

The data the server must see is committed once for the module and removed at the end."""

from __future__ import annotations

import pytest

from apps.nodes.models import Node
from apps.tenants.services import add_member, create_tenant
from tests.factories import UserFactory, make_bound_slice, make_slice
from tests.nodes.payloads import heartbeat
from tests.portal.browser.support import (  # skips this module without a browser
    PASSWORD,
    SCREENSHOTS,
    WAIT_MS,
    beat,
    committed,
    follow_menu,
    live_portal,
    sync_api,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db]
expect = sync_api.expect
NODE = "gpu-h200-03"


def carve() -> dict:
    orbit = create_tenant(name="Orbit Labs", slug="orbit")
    other = create_tenant(name="Nebula", slug="nebula")
    UserFactory(username="orbit-dev", password=PASSWORD)
    add_member(orbit, username="orbit-dev", role="member")
    node = Node.objects.get(pk=NODE)
    mine = make_bound_slice(
        node, orbit, state="confirmed", device_id="MIG-5c3a", handles={"gi": 1, "ci": 0}, reason={"why": "MIG on"}
    )
    theirs = make_bound_slice(node, other, state="issued", profile="2g.35gb", memory_mb=35 * 1024)
    make_slice(node, None, gpu_index=1, state="orphaned", device_id="MIG-lost")
    return {"mine": mine.pk, "mine_task": mine.task_id, "theirs_task": theirs.task_id}


def seed(url: str) -> dict:
    beat(url, NODE, heartbeat(gpus=2, hostname=NODE, internal_ip="10.0.0.23"))
    return {"rows": committed(carve)}


@pytest.fixture(scope="module")
def live(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), live_portal(seed) as world:
        yield world


@pytest.fixture(scope="module")
def page(live):
    context = live["browser"].new_context(viewport={"width": 1360, "height": 900}, base_url=live["url"])
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto("/portal/login/")
    page.fill("#id_username", "orbit-dev")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    expect(page.locator("#status-bar")).to_be_visible()
    yield page
    context.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"slices-{name}.png"), full_page=True)


def test_a_member_reads_the_carved_card_and_follows_it_to_the_node(page, live):
    rows = live["rows"]
    page.goto("/portal/")
    follow_menu(page, "Fleet", "Slices")
    expect(page.locator("h1")).to_have_text("Slices")
    card = page.locator(f'[data-card="{NODE}/0"]')
    expect(card).to_be_visible()
    expect(page.locator("[data-card]")).to_have_count(1)  # the orphan's card is not the member's
    expect(card.locator(".slice-seg")).to_have_count(2)
    expect(card.locator(".slice-seg.other")).to_have_count(1)
    assert card.locator(".slice-seg").first.bounding_box()["width"] > 0
    expect(card).to_contain_text(f"#{rows['mine_task']} sliced-confirmed")
    expect(card).to_contain_text("another tenant's")
    expect(card).not_to_contain_text("nebula")
    expect(page.locator(f'[data-slice-row="{rows["mine"]}"]')).to_contain_text("MIG-5c3a")
    expect(page.locator("[data-slice-row]")).to_have_count(1)
    shot(page, "page")

    page.select_option("select[name=state]", "released")
    page.click("text=Filter")
    expect(page.locator("[data-slice-row]")).to_have_count(0)

    page.goto("/portal/slices/")
    page.locator(f'[data-card="{NODE}/0"] h3 a').click()
    row = page.locator('[data-gpu-slices="0"]')
    expect(row.locator(".slice-seg")).to_have_count(2)
    expect(row).to_contain_text(f"#{rows['mine_task']} sliced-confirmed")
    expect(page.locator('[data-gpu-slices="1"]')).to_contain_text("left on the card, being destroyed")
    shot(page, "node-detail")
