"""The Inference page in a real browser (Chromium driven by Playwright against the control
plane under uvicorn, as tests/portal/browser/test_walkthrough.py does): a tenant member
deploys a service through the form (a scheduling window ticked on, its days and times),
reads its detail (replicas placed by a real scheduler cycle on a node registered by
heartbeat, the window, the decisions), scales it and stops it (accepting the confirmation
dialog). Each page is saved under test-artefacts/screenshots/.

The data the server must see is committed once for the module and removed at the end."""

from __future__ import annotations

import re

import pytest

from apps.inference.models import InferenceService, Model
from apps.scheduler.services import run_cycle
from apps.tenants.services import add_member, create_tenant
from tests.factories import UserFactory
from tests.nodes.payloads import heartbeat
from tests.portal.browser.support import (
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


def seed(url: str) -> None:
    orbit = create_tenant(name="Orbit Labs", slug="orbit")
    UserFactory(username="orbit-dev", password=PASSWORD)
    add_member(orbit, username="orbit-dev", role="member")
    Model.objects.create(tenant=orbit, name="qwen3-8b", source_kind="path", source="/models/qwen3-8b", format="gguf")
    beat(url, "gpu-h100-09", heartbeat(gpus=4, hostname="gpu-h100-09", internal_ip="10.0.0.19"))


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
    page.screenshot(path=str(SCREENSHOTS / f"inference-{name}.png"), full_page=True)


def test_a_member_deploys_scales_and_stops_a_service(page):
    page.goto("/portal/")
    follow_menu(page, "Work", "Inference")
    expect(page.locator("h1")).to_have_text("Inference")
    page.click("text=Deploy a service")
    page.fill("#name", "chat")
    page.select_option("#model", "qwen3-8b")
    page.select_option("#engine", "llama.cpp")
    page.select_option("#gpu_type", "nvidia")
    page.fill("#min_replicas", "1")
    page.fill("#max_replicas", "3")
    page.fill("#sleep_after_seconds", "1800")
    page.check("input[name=window_on]")
    page.uncheck("input[name=window_days][value=fri]")
    page.check("input[name=window_days][value=sat]")
    page.fill("#window_ranges", "22:00-02:00")
    page.fill("#window_timezone", "Europe/Berlin")
    page.select_option("#window_action", "pause")
    shot(page, "deploy-form")
    page.click("#inference-form button[type=submit]")
    expect(page.locator("[role=status]")).to_contain_text("'chat' deployed: 1 replicas asked.")
    service = InferenceService.objects.get(group__name="chat")
    assert service.window == {
        "days": ["mon", "tue", "wed", "thu", "sat"],
        "ranges": [{"start": "22:00", "end": "02:00"}],
        "timezone": "Europe/Berlin",
        "action": "pause",
    }
    expect(page.locator("[data-window]")).to_contain_text("mon, tue, wed, thu, sat, 22:00–02:00 (Europe/Berlin)")
    expect(page.locator("[data-service-state]")).to_have_text("starting")

    committed(run_cycle)  # the scheduler places the replica on the node that beat
    page.reload()
    row = page.locator('tr[data-rank="0"]')
    expect(row.locator("[data-rank-node] a")).to_have_attribute("href", "/portal/nodes/gpu-h100-09/")
    expect(row).to_contain_text(re.compile(r"80\d\d"))
    expect(row.locator("[data-health]")).to_have_attribute("data-health", "not-running")
    shot(page, "detail")

    page.fill("#replicas", "9")
    page.click("#scale-form button[type=submit]")
    expect(page.locator(".messages")).to_contain_text("Between min_replicas (1) and max_replicas (3)")
    page.fill("#replicas", "2")
    page.click("#scale-form button[type=submit]")
    expect(page.locator("[role=status]")).to_contain_text("asks for 2 replicas.")
    expect(page.locator("tr[data-decision] [data-reason]").first).to_have_text("scaled by orbit-dev from 1 to 2")
    expect(page.locator("tr[data-rank]")).to_have_count(2)

    page.once("dialog", lambda dialog: dialog.accept())
    page.click("text=Stop")
    expect(page.locator("[role=status]")).to_contain_text(re.compile(r"is stopp(ing|ed)\."))
    expect(page.locator("button", has_text="Stop")).to_have_count(0)
    shot(page, "stopped")
