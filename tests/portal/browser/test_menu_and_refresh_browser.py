"""In a real browser (Chromium, Playwright, the control plane under uvicorn): the portal's
menu at a desktop's and at a phone's width, by mouse, keyboard and without JavaScript;
the nodes page refreshing itself in place as heartbeats change a node; the dashboard's
control-plane panel polling every 5 s, keeping its last data and marking it stale while
its reads fail, and clearing the mark when they answer again.

Time in the page is Playwright's clock, paused: a test moves it on by the refresh period
instead of waiting for it, and the page's timers fire as they would. A read is made to fail by
answering it 500 in the browser (page.route), as a control plane being restarted does."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from apps.core.clock import utcnow
from apps.monitoring import hostmetrics
from apps.monitoring import services as monitoring_services
from apps.tenants.services import add_member, create_tenant
from tests.factories import OperatorFactory, UserFactory
from tests.nodes.payloads import heartbeat
from tests.portal.browser.support import (  # skips this module without a browser
    PASSWORD,
    SCREENSHOTS,
    Browser,
    beat,
    live_portal,
    sync_api,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db]
expect = sync_api.expect

DESKTOP, PHONE = 1280, 390
NODES = ("ui-node-01", "ui-node-02")
GROUPS = {
    "Fleet": ["Nodes", "Monitor", "GPU health", "Environment", "Slices", "Energy"],
    "Work": ["Tasks", "Queues", "Estimate accuracy", "Simulations", "Training", "Inference", "Models"],
    "Serving": ["Endpoint keys", "Usage"],
    "Account": ["API keys", "Members", "Admin", "Sign out ui-ops"],
}
# what a tenant's member sees: no operators' links
MEMBER_GROUPS = GROUPS | {
    "Work": [link for link in GROUPS["Work"] if link not in ("Estimate accuracy", "Simulations")],
    "Account": ["API keys", "Sign out luna-dev"],
}


def node_beat(node_id: str, **overrides) -> dict:
    return heartbeat(gpus=2, hostname=node_id, internal_ip="10.0.9." + node_id[-1], **overrides)


def store_hot_host() -> None:
    """A control-plane host whose newest sample is over spec 003's limits: CPU 85 % and
    disk 92 % red, memory 75 % not (no amber step below 80 %)."""
    monitoring_services.record_sample(
        "cp-hot",
        hostmetrics.HostSample(
            cpu_percent=85.0,
            memory_percent=75.0,
            memory_used_bytes=48 << 30,
            memory_total_bytes=64 << 30,
            disk_percent=92.0,
            disk_used_bytes=460 << 30,
            disk_total_bytes=500 << 30,
            load_1=3.0,
            load_5=2.0,
            load_15=1.0,
            net_recv_bytes=None,
            net_sent_bytes=None,
            uptime_seconds=3600,
            cpu_temperature_celsius=None,
        ),
        utcnow(),
    )


def seed(url: str) -> None:
    OperatorFactory(username="ui-ops", password=PASSWORD)
    tenant = create_tenant(name="Luna Labs", slug="luna")
    UserFactory(username="luna-dev", password=PASSWORD)
    add_member(tenant, username="luna-dev", role="member")
    for node_id in NODES:
        beat(url, node_id, node_beat(node_id, agent_version="2.4.1", agent_git_commit="9f1c2ab"))
    store_hot_host()


@pytest.fixture(scope="module")
def live(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), live_portal(seed) as world:
        yield world


@pytest.fixture(scope="module")
def operator(live):
    browser = Browser(live, "ui-ops")
    yield browser
    browser.close()


@pytest.fixture(scope="module")
def member(live):
    browser = Browser(live, "luna-dev")
    yield browser
    browser.close()


@pytest.fixture
def timed(live):
    """An operator's page on Playwright's clock, paused: the page's timers fire only when
    a test moves the clock on (a context of its own: the clock stays installed for the
    page's life)."""
    browser = Browser(live, "ui-ops")
    now = datetime.now(UTC)
    browser.page.clock.install(time=now)
    browser.page.clock.pause_at(now + timedelta(seconds=1))
    yield browser
    browser.close()


# --- the menu ---------------------------------------------------------------------------------


def no_horizontal_overflow(page) -> None:
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    if overflow > 0:  # name the widest culprits, outermost first
        wide = page.evaluate(
            """() => Array.from(document.querySelectorAll("body *"))
                 .filter(el => el.getBoundingClientRect().right > document.documentElement.clientWidth)
                 .slice(0, 8)
                 .map(el => `${el.tagName}.${el.className} ${Math.round(el.getBoundingClientRect().right)}`)"""
        )
        pytest.fail(f"{page.url} is {overflow} px wider than the window: {wide}")


def summary(page, group: str):
    return page.locator(f'nav.menus summary:text-is("{group}")')


def check_every_link_reachable(page, groups: dict, width: int) -> None:
    for group, links in groups.items():
        summary(page, group).click()
        items = page.locator("nav.menus details[open] .menu-items li")
        expect(items).to_have_text(links)
        for i in range(len(links)):
            item = items.nth(i).locator("a, button")
            expect(item).to_be_visible()
            box = item.bounding_box()
            assert 0 <= box["x"] and box["x"] + box["width"] <= width, (group, links[i], box)
        no_horizontal_overflow(page)
    page.locator("main").click(position={"x": 2, "y": 2})  # a click elsewhere closes the group
    expect(page.locator("nav.menus details[open]")).to_have_count(0)


def border_colour(locator) -> str:
    return locator.evaluate("el => getComputedStyle(el).borderBottomColor")


def background(locator) -> str:
    return locator.evaluate("el => getComputedStyle(el).backgroundColor")


@pytest.mark.parametrize("width", [DESKTOP, PHONE])
def test_the_menu_reaches_every_link_and_marks_the_page_at_a_desktops_and_a_phones_width(operator, width):
    page = operator.page
    operator.violations.clear()
    page.set_viewport_size({"width": width, "height": 800})
    page.goto("/portal/training/")
    no_horizontal_overflow(page)
    top = page.locator("nav.menus > ul > li > a.top")
    expect(top).to_have_text(["Dashboard", "Alerts"])
    for link in ("Dashboard", "Alerts"):
        box = page.locator(f'nav.menus a.top:text-is("{link}")').bounding_box()
        assert box["x"] + box["width"] <= width
    check_every_link_reachable(page, GROUPS, width)
    # the page is marked on its group and on its item, in the markup and to the eye
    work, fleet = summary(page, "Work"), summary(page, "Fleet")
    expect(work).to_have_attribute("aria-current", "true")
    expect(page.locator("nav.menus summary[aria-current]")).to_have_count(1)
    assert border_colour(work) != border_colour(fleet)
    work.click()
    training = page.locator('nav.menus .menu-items a:text-is("Training")')
    expect(training).to_have_attribute("aria-current", "page")
    expect(page.locator('nav.menus a[aria-current="page"]')).to_have_count(1)
    assert background(training) != background(page.locator('nav.menus .menu-items a:text-is("Tasks")'))
    page.screenshot(path=str(SCREENSHOTS / f"menu-{width}.png"))
    # a link followed from the menu marks its own page
    page.locator('nav.menus .menu-items a:text-is("Tasks")').click()
    expect(page).to_have_url(re.compile(r"/portal/tasks/$"))
    expect(page.locator('nav.menus a[aria-current="page"]')).to_have_text("Tasks")
    expect(page.locator("nav.menus details[open]")).to_have_count(0)
    page.goto("/portal/")
    expect(page.locator('nav.menus a.top[aria-current="page"]')).to_have_text("Dashboard")
    expect(page.locator("nav.menus summary[aria-current]")).to_have_count(0)
    no_horizontal_overflow(page)
    assert operator.violations == []


def test_the_menu_by_keyboard(operator):
    page = operator.page
    page.set_viewport_size({"width": DESKTOP, "height": 800})
    page.goto("/portal/alerts/")
    page.locator("a.brand").focus()
    page.keyboard.press("Tab")  # Dashboard
    page.keyboard.press("Tab")
    fleet = summary(page, "Fleet")
    expect(fleet).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.locator('details[data-menu="fleet"]')).to_have_attribute("open", "")
    page.keyboard.press("Tab")
    expect(page.locator('nav.menus a:text-is("Nodes")')).to_be_focused()
    page.keyboard.press("Escape")  # closes the group and gives the focus back to it
    expect(page.locator("nav.menus details[open]")).to_have_count(0)
    expect(fleet).to_be_focused()
    # one group at a time; Tab past a group's last item closes it
    page.keyboard.press("Enter")
    for _ in GROUPS["Fleet"]:
        page.keyboard.press("Tab")
    expect(page.locator('nav.menus a:text-is("Energy")')).to_be_focused()
    page.keyboard.press("Tab")
    expect(summary(page, "Work")).to_be_focused()
    expect(page.locator("nav.menus details[open]")).to_have_count(0)
    page.keyboard.press("Space")
    summary(page, "Serving").click()
    expect(page.locator("nav.menus details[open]")).to_have_attribute("data-menu", "serving")
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")
    expect(page).to_have_url(re.compile(r"/portal/endpoint-keys/$"))


def test_the_menu_works_without_javascript(live):
    context = live["browser"].new_context(
        viewport={"width": PHONE, "height": 800}, base_url=live["url"], java_script_enabled=False
    )
    try:
        page = context.new_page()
        page.goto("/portal/login/")
        page.fill("#id_username", "luna-dev")
        page.fill("#id_password", PASSWORD)
        page.click("button[type=submit]")
        expect(page.locator("#status-bar")).to_be_visible()
        for group, links in MEMBER_GROUPS.items():
            summary(page, group).click()
            expect(page.locator(f'details[data-menu="{group.lower()}"] .menu-items li')).to_have_text(links)
            summary(page, group).click()  # without the script a group closes on its own summary
        no_horizontal_overflow(page)
        summary(page, "Fleet").click()
        page.locator('nav.menus a:text-is("Nodes")').click()
        expect(page.locator("h1")).to_have_text("Nodes")
        expect(summary(page, "Fleet")).to_have_attribute("aria-current", "true")
    finally:
        context.close()


def test_operator_only_links_stay_operator_only(member):
    page = member.page
    member.violations.clear()
    page.set_viewport_size({"width": PHONE, "height": 800})
    page.goto("/portal/nodes/")
    check_every_link_reachable(page, MEMBER_GROUPS, PHONE)
    expect(page.locator('nav.menus a[href="/portal/members/"], nav.menus a[href="/admin/"]')).to_have_count(0)
    assert member.violations == []


# --- the nodes page refreshes itself -------------------------------------------------------------


def card(page, node_id: str):
    return page.locator(f'#node-cards .node-card[data-node="{node_id}"]')


def test_the_nodes_page_updates_in_place_when_a_node_changes(timed, live):
    page = timed.page
    page.set_viewport_size({"width": DESKTOP, "height": 500})  # short: the page scrolls
    page.goto("/portal/nodes/?q=ui-node&sort=name")
    expect(page.locator("#node-cards .node-card")).to_have_count(2)
    expect(card(page, "ui-node-02").locator("[data-agent-version]")).to_have_text("2.4.1")
    expect(card(page, "ui-node-02").locator("[data-agent-dirty]")).to_have_count(0)
    expect(page.locator("[data-fleet-uniform]")).to_have_text("one version")
    # what a reload would lose: a mark on the window, a search typed but not sent, the
    # scroll position, the keyboard focus, and the untouched card's very element
    page.evaluate("window.__kept = 'yes'")
    page.fill("#q", "typed, not sent")
    card(page, "ui-node-02").focus()
    page.evaluate("window.scrollTo(0, 120)")
    assert page.evaluate("window.scrollY") == 120
    in_view = card(page, "ui-node-01").bounding_box()["y"]
    page.evaluate("document.querySelector('[data-node=\"ui-node-01\"]').__same = true")

    # the agent on ui-node-02 is upgraded to a dirty build, then stops (its farewell beat)
    beat(live["url"], "ui-node-02", node_beat("ui-node-02", agent_version="2.5.0", agent_git_commit="abc1234-dirty"))
    beat(
        live["url"],
        "ui-node-02",
        node_beat("ui-node-02", agent_version="2.5.0", agent_git_commit="abc1234-dirty", shutting_down=True),
    )
    with page.expect_response(lambda r: "/portal/node-cards/?q=ui-node&sort=name" in r.url) as answer:
        page.clock.run_for(30_000)  # the 30 s tick
    assert answer.value.status == 200
    changed = card(page, "ui-node-02")
    expect(changed).to_have_attribute("data-status", "offline")
    expect(changed.locator(".badge.offline")).to_have_text("offline")
    expect(changed.locator("[data-agent-version]")).to_have_text("2.5.0")
    expect(changed.locator("[data-agent-commit]")).to_have_text("abc1234-dirty")
    expect(changed.locator("[data-agent-dirty]")).to_have_text("dirty build")
    expect(page.locator("[data-fleet-mismatch]")).to_have_text("mismatch: 2 versions in use")
    expect(page.locator("[data-fleet-dirty]")).to_contain_text("1 node runs an agent built from")
    expect(page.locator("#nodes-updated")).to_have_text(re.compile(r"^Updated .*; refreshes every 30 s\.$"))
    assert page.evaluate("window.__kept") == "yes"  # no reload
    assert page.evaluate("document.querySelector('[data-node=\"ui-node-01\"]').__same") is True  # left as it was
    expect(page.locator("#q")).to_have_value("typed, not sent")
    # still scrolled: the cards stay where they were in the window, though the agent
    # versions above them grew (the browser keeps the view anchored)
    assert page.evaluate("window.scrollY") > 0
    assert abs(card(page, "ui-node-01").bounding_box()["y"] - in_view) <= 1
    expect(changed).to_be_focused()
    expect(page).to_have_url(re.compile(r"/portal/nodes/\?q=ui-node&sort=name$"))
    assert timed.violations == []


def test_the_nodes_refresh_pauses_while_hidden_and_marks_a_failed_read_stale(timed, live):
    page = timed.page
    page.goto("/portal/nodes/?sort=name")
    reads = []
    page.on("request", lambda r: reads.append(r.url) if "/portal/node-cards/" in r.url else None)
    # a hidden tab skips its ticks
    page.evaluate(
        """() => {
          window.__hidden = true;
          Object.defineProperty(document, "hidden", { configurable: true, get: () => window.__hidden });
          Object.defineProperty(document, "visibilityState", { configurable: true,
            get: () => (window.__hidden ? "hidden" : "visible") });
          document.dispatchEvent(new Event("visibilitychange"));
        }"""
    )
    page.clock.run_for(95_000)  # three ticks
    assert reads == []
    # shown again after a skipped tick: read at once
    with page.expect_response(lambda r: "/portal/node-cards/" in r.url):
        page.evaluate("() => { window.__hidden = false; document.dispatchEvent(new Event('visibilitychange')); }")
    expect(page.locator("#nodes-updated")).to_have_text(re.compile(r"^Updated "))

    # the control plane answers 500: the cards stay, marked stale; then it answers again
    page.route("**/portal/node-cards/**", lambda route: route.fulfill(status=500, body="restarting"))
    with page.expect_response(lambda r: "/portal/node-cards/" in r.url and r.status == 500):
        page.clock.run_for(30_000)
    note = page.locator("#nodes-updated")
    expect(note).to_have_text(re.compile(r"^Stale since \d.*: could not refresh \(HTTP 500\)\. Showing the nodes"))
    expect(note).to_have_class(re.compile(r"\bstale\b"))
    expect(page.locator("#node-cards .node-card")).to_have_count(2)
    page.unroute("**/portal/node-cards/**")
    with page.expect_response(lambda r: "/portal/node-cards/" in r.url and r.status == 200):
        page.clock.run_for(30_000)
    expect(note).to_have_text(re.compile(r"^Updated "))
    expect(note).not_to_have_class(re.compile(r"\bstale\b"))
    expect(page.locator("#node-cards")).not_to_have_class(re.compile(r"stale-data"))
    assert timed.violations == []


# --- the control-plane panel ---------------------------------------------------------------------

PANEL_READS = re.compile(r"/(portal/server/hosts/|api/v1/server/metrics|api/v1/server/health-check)$")


def poll(page, reads: list) -> list:
    """Moves the page's clock on by the panel's 5 s and waits until what that poll read
    is shown; returns the addresses it read."""
    reads.clear()
    page.clock.run_for(5_000)
    page.evaluate("window.heteroflowServerPanel.settled()")
    return sorted(url.split("/", 3)[3] for url in reads)


def test_the_server_panel_polls_every_5_s_and_keeps_its_last_data_marked_stale_while_reads_fail(timed):
    page = timed.page
    reads = []
    page.on("request", lambda r: reads.append(r.url) if PANEL_READS.search(r.url) else None)
    page.goto("/portal/")
    page.evaluate("window.heteroflowServerPanel.settled()")  # this host's first reading, if it had no sample
    panel = page.locator("#server-panel")
    hot = panel.locator('.host-card[data-host="cp-hot"]')
    # the page's first state, coloured by spec 003's limits
    expect(hot.locator('[data-reading="cpu"]')).to_have_class(re.compile(r"\bhigh\b"))  # 85 %
    expect(hot.locator('[data-reading="memory"]')).to_have_class(re.compile(r"\bok\b"))  # 75 %
    expect(hot.locator('[data-reading="disk"]')).to_have_class(re.compile(r"\bhigh\b"))  # 92 %
    stale = page.locator("#server-stale")
    expect(stale).to_be_hidden()

    # nothing before the 5 s are up; then the poll: the stored samples, the live reading, the health check
    reads.clear()
    page.clock.run_for(4_000)
    assert reads == []
    page.clock.run_for(1_000)
    page.evaluate("window.heteroflowServerPanel.settled()")
    assert sorted(url.split("/", 3)[3] for url in reads) == [
        "api/v1/server/health-check",
        "api/v1/server/metrics",
        "portal/server/hosts/",
    ]
    updated = page.locator("#server-updated")
    expect(updated).to_have_text(re.compile(r"^Cards and health check updated .*\.$"))
    # the script colours the cards by the same limits
    expect(hot.locator('[data-reading="cpu"]')).to_have_class(re.compile(r"\bhigh\b"))
    expect(hot.locator('[data-reading="memory"]')).to_have_class(re.compile(r"\bok\b"))
    expect(hot.locator('[data-reading="disk"]')).to_have_class(re.compile(r"\bhigh\b"))
    checks = panel.locator("#server-checks tr[data-check]")
    expect(checks).to_have_count(6)
    verdict = panel.locator("[data-verdict]").inner_text()

    # every read fails (the control plane restarting): the last data stays, marked stale
    page.route(PANEL_READS, lambda route: route.fulfill(status=500, body="restarting"))
    assert len(poll(page, reads)) == 3
    expect(stale).to_be_visible()
    expect(stale).to_have_text(re.compile(r"^stale since \d{1,2}:\d{2}:\d{2}"))
    expect(stale).to_have_attribute("title", re.compile(r"^Could not read: stored samples \(HTTP 500\), live "))
    expect(panel.locator("#server-hosts")).to_have_attribute("data-stale", "true")
    expect(panel.locator("table.health")).to_have_attribute("data-stale", "true")
    expect(hot.locator('[data-reading="cpu"]')).to_have_text("85%")  # the last data, kept
    expect(hot.locator('[data-reading="cpu"]')).to_have_class(re.compile(r"\bhigh\b"))
    expect(checks).to_have_count(6)
    expect(panel.locator("[data-verdict]")).to_have_text(verdict)
    expect(updated).to_have_text(re.compile(r"^Could not read: .*; showing what was read at "))
    since = stale.inner_text()
    # a poll that fails again keeps the moment it went stale
    assert len(poll(page, reads)) == 3
    expect(stale).to_have_text(since)

    # only the health check still fails: the cards are fresh, the checks are not
    page.unroute(PANEL_READS)
    page.route("**/api/v1/server/health-check", lambda route: route.fulfill(status=500, body="restarting"))
    poll(page, reads)
    expect(panel.locator("#server-hosts")).not_to_have_attribute("data-stale", "true")
    expect(panel.locator("table.health")).to_have_attribute("data-stale", "true")
    expect(stale).to_have_text(since)
    expect(stale).to_have_attribute("title", re.compile(r"^Could not read: health check \(HTTP 500\)\."))

    # the reads answer again: the mark goes
    page.unroute("**/api/v1/server/health-check")
    poll(page, reads)
    expect(stale).to_be_hidden()
    expect(panel.locator("[data-stale]")).to_have_count(0)
    expect(updated).to_have_text(re.compile(r"^Cards and health check updated .*\.$"))
    assert timed.violations == []
