"""The portal under its Content-Security-Policy in a real browser (Chromium, Playwright,
the control plane under uvicorn): every page of an operator and of a tenant member,
and the admin, loads with no policy violation reported by the browser, and the form
behaviours that moved out of inline handlers into static/portal/forms.js still work (a
confirmation before a stop, a select that sends its form)."""

from __future__ import annotations

import re

import pytest

from apps.tasks.services import create_task
from apps.tenants.services import add_member, create_tenant
from tests.factories import OperatorFactory, UserFactory
from tests.nodes.payloads import heartbeat
from tests.portal.browser.support import (  # skips this module without a browser
    PASSWORD,
    Browser,
    beat,
    live_portal,
    sync_api,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db]
expect = sync_api.expect

OPERATOR_PAGES = [
    "/portal/",
    "/portal/nodes/",
    "/portal/nodes/csp-node-01/",
    "/portal/nodes/monitor/",
    "/portal/environment/",
    "/portal/tasks/",
    "/portal/tasks/new/",
    "/portal/training/",
    "/portal/inference/",
    "/portal/models/",
    "/portal/alerts/",
    "/portal/endpoint-keys/",
    "/portal/gateway-usage/",
    "/portal/training/new/",
    "/portal/inference/new/",
    "/portal/models/new/",
    "/portal/keys/",
    "/portal/members/",
    "/admin/",
    "/admin/tenants/tenant/",
    "/api/docs/",
]
MEMBER_PAGES = ["/portal/", "/portal/nodes/", "/portal/tasks/", "/portal/keys/"]


def seed(url: str) -> dict:
    OperatorFactory(username="csp-ops", password=PASSWORD)
    tenant = create_tenant(name="Csp Labs", slug="csp")
    UserFactory(username="csp-dev", password=PASSWORD)
    add_member(tenant, username="csp-dev", role="admin")
    beat(url, "csp-node-01", heartbeat(gpus=2, hostname="csp-node-01", internal_ip="10.0.0.31"))
    return {"task": create_task(tenant=tenant, name="csp-job", image="busybox", gpu_required=1)}


@pytest.fixture(scope="module")
def live(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), live_portal(seed) as world:
        yield world


@pytest.fixture(scope="module")
def operator(live):
    browser = Browser(live, "csp-ops")
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def member(live):
    browser = Browser(live, "csp-dev")
    yield browser
    browser.close()


def visit_all(browser, pages):
    browser.violations.clear()
    for path in pages:
        response = browser.page.goto(path)
        assert response.status == 200, path
        assert response.headers.get("content-security-policy"), path
        browser.page.wait_for_load_state("load")
    return browser.violations


def test_no_operator_page_breaks_the_policy(operator):
    assert visit_all(operator, OPERATOR_PAGES) == []


def test_no_member_page_breaks_the_policy(member):
    assert visit_all(member, MEMBER_PAGES) == []


def test_a_select_with_data_autosubmit_sends_its_form(operator):
    operator.violations.clear()
    operator.page.goto("/portal/nodes/")
    sort = operator.page.locator("#sort")
    other = [value for value in sort.locator("option").evaluate_all("os => os.map(o => o.value)") if value][-1]
    sort.select_option(other)
    expect(operator.page).to_have_url(re.compile(rf"[?&]sort={re.escape(other)}"))
    assert operator.violations == []


def test_a_form_with_data_confirm_asks_first_and_a_no_sends_nothing(member, live):
    page = member.page
    member.violations.clear()
    page.goto(f"/portal/tasks/{live['task'].pk}/")
    asked = []

    def decline(dialog):
        asked.append(dialog.message)
        dialog.dismiss()

    page.once("dialog", decline)
    page.locator("form[data-confirm] button[type=submit]").click()
    expect(page.locator("[data-task-status]")).to_have_text("pending")
    assert asked and asked[0].endswith(f"task #{live['task'].pk}?")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("form[data-confirm] button[type=submit]").click()
    expect(page.locator("[data-task-status]")).not_to_have_text("pending")
    assert member.violations == []
