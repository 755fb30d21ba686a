"""The portal in a real browser: Chromium driven by Playwright against the control plane
under uvicorn. An operator and a tenant member sign in and walk the pages; every page
is saved as a screenshot under test-artefacts/screenshots/.

The cluster is real: nodes register by heartbeats posted to the live server (one loses
a card on the way), tasks are submitted through the form and placed by a real scheduler
cycle. Only the monitor's past hour is written straight into node_metrics, in the rows'
own shape: a heartbeat cannot be sent in the past. The control-plane hosts' past week is
stored through the monitoring service that collects host samples (this host's newest one
read from the machine itself).

One browser for the module, one signed-in context per person. The data is committed
once for the module (the server process sees only committed rows) and removed at the
end, so the module leaves the test database as it found it."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
import requests
from django.db import connection  # noqa: E402

from apps.alerts.choices import AlertScope, AlertType, Severity  # noqa: E402
from apps.alerts.models import Alert  # noqa: E402
from apps.alerts.services import raise_alert  # noqa: E402
from apps.core.clock import utcnow  # noqa: E402
from apps.monitoring import hostmetrics  # noqa: E402
from apps.monitoring import services as monitoring_services  # noqa: E402
from apps.nodes.models import Node  # noqa: E402
from apps.nodes.services import assign_tenant  # noqa: E402
from apps.scheduler.services import run_cycle  # noqa: E402
from apps.tasks.models import Task  # noqa: E402
from apps.tasks.services import create_task  # noqa: E402
from apps.tenants.models import ApiKey  # noqa: E402
from apps.tenants.services import add_member, create_tenant  # noqa: E402
from tests.factories import OperatorFactory, UserFactory  # noqa: E402
from tests.headers import bearer_http  # noqa: E402
from tests.live import wait_until  # noqa: E402
from tests.nodes.payloads import gpu_stat, heartbeat  # noqa: E402
from tests.portal.browser.support import (  # skips this module without a browser
    PASSWORD,
    SCREENSHOTS,
    WAIT_MS,
    committed,
    live_portal,
    sync_api,
)
from tests.portal.browser.support import beat as send_beat

# The mark makes pytest-django set up the test database; each test then runs in a
# transaction of its own that the server cannot see, so what a test changes for the
# server to show is done through `committed` (a thread: its own connection, autocommit).
pytestmark = [pytest.mark.browser, pytest.mark.django_db]


def backfill_history(node_id: str, gpus: int, minutes: int = 60) -> None:
    """The node's past hour, one row every 20 s, as the heartbeat writes them."""
    now = utcnow()
    rows = []
    for step in range(minutes * 3, 0, -1):
        wave = (step % 30) / 30
        cards = [
            {
                "i": i,
                "u": round(20 + 60 * wave + i, 1),
                "m": 20480 + 4096 * i,
                "t": 50 + 10 * wave,
                "p": 250 + 100 * wave,
            }
            for i in range(gpus)
        ]
        rows.append((node_id, now - timedelta(seconds=20 * step), 20 + 30 * wave, 40 + 10 * wave, json.dumps(cards)))
    with connection.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO node_metrics (node_id, at, cpu_used, memory_used, gpus) VALUES (%s, %s, %s, %s, %s::jsonb)",
            rows,
        )


OTHER_HOST = "cp-standby"
GAP_MINUTES = (35, 50)  # the other host stored nothing then: a gap in its lines, not zeros


def backfill_server_samples() -> None:
    """This host and another over the past week, through the service that stores host
    samples (rates computed from each host's previous sample). Every 30 s for the last two
    hours; before that as often as each range's buckets need (5 min back to 6 h, 15 min to
    24 h, 30 min to 7 days), which keeps the module's set-up short. This host's newest
    sample is a real reading of the machine, and its past counters lead up to the real
    ones, so the rates stay true across the real reading."""
    now = utcnow()
    this_host = hostmetrics.host_name()
    real, _window = hostmetrics.read_host()
    seconds_ago = [s for s in range(168 * 3600 - 1800, 24 * 3600, -1800)] + [
        s for s in range(24 * 3600, 6 * 3600, -900)
    ]
    seconds_ago += [s for s in range(6 * 3600, 2 * 3600, -300)] + [s for s in range(2 * 3600, 0, -30)]
    mine_rate = min(50_000, (real.net_recv_bytes or 0) // (8 * 86400))  # bytes/s the counters grew by
    standby_in, standby_out = 10_000_000, 5_000_000
    previous = seconds_ago[0]
    for n, ago in enumerate(seconds_ago):
        at = now - timedelta(seconds=ago)
        wave = (n % 20) / 20
        mine = hostmetrics.HostSample(
            cpu_percent=round(15 + 50 * wave, 1),
            memory_percent=round(45 + 10 * wave, 1),
            memory_used_bytes=29 << 30,
            memory_total_bytes=64 << 30,
            disk_percent=61.0,
            disk_used_bytes=305 << 30,
            disk_total_bytes=500 << 30,
            load_1=round(1 + 2 * wave, 2),
            load_5=1.5,
            load_15=1.2,
            net_recv_bytes=None if real.net_recv_bytes is None else real.net_recv_bytes - mine_rate * ago,
            net_sent_bytes=None if real.net_sent_bytes is None else real.net_sent_bytes - mine_rate // 4 * ago,
            uptime_seconds=None,
            cpu_temperature_celsius=round(48 + 10 * wave, 1),
        )
        monitoring_services.collect_server_metrics(at, read=lambda sample=mine: (sample, 1.0))
        standby_in += int((60_000 + 60_000 * wave) * (previous - ago))  # 59 to 117 KiB/s received
        standby_out += int(30_000 * (previous - ago))
        previous = ago
        if GAP_MINUTES[0] * 60 <= ago < GAP_MINUTES[1] * 60:
            continue
        monitoring_services.record_sample(
            OTHER_HOST,
            hostmetrics.HostSample(
                cpu_percent=round(70 + 20 * wave, 1),
                memory_percent=72.0,
                memory_used_bytes=46 << 30,
                memory_total_bytes=64 << 30,
                disk_percent=38.5,
                disk_used_bytes=190 << 30,
                disk_total_bytes=500 << 30,
                load_1=round(3 + wave, 2),
                load_5=3.2,
                load_15=3.1,
                net_recv_bytes=standby_in,
                net_sent_bytes=standby_out,
                uptime_seconds=9 * 86400 - ago,
                cpu_temperature_celsius=None,
            ),
            at,
        )
    assert monitoring_services.collect_server_metrics(now, read=lambda: (real, 1.0))  # the machine's own reading
    assert this_host != OTHER_HOST


def build_cluster(url: str) -> dict:
    operator = OperatorFactory(username="ops", password=PASSWORD)
    orbit = create_tenant(name="Orbit Labs", slug="orbit")
    vega = create_tenant(name="Vega AI", slug="vega")
    member = UserFactory(username="orbit-dev", password=PASSWORD)
    add_member(orbit, username=member.username, role="member")
    add_member(vega, username=member.username, role="viewer")  # a second tenant: the switcher shows
    UserFactory(username="vega-dev", password=PASSWORD)
    add_member(vega, username="vega-dev", role="admin")
    # nodes register by heartbeat; gpu-a100-01 then loses card 3 (absent three beats running)
    last_beats = {}

    def beat(url, node_id, payload):
        send_beat(url, node_id, payload)
        last_beats[node_id] = payload

    a100 = [gpu_stat(i, model="NVIDIA A100-SXM4-80GB", memory_total_mb=81920) for i in range(4)]
    beat(url, "gpu-a100-01", heartbeat(gpu_stats=a100, hostname="gpu-a100-01", internal_ip="10.0.0.11"))
    for _ in range(3):
        beat(url, "gpu-a100-01", heartbeat(gpu_stats=a100[:3], hostname="gpu-a100-01", internal_ip="10.0.0.11"))
    beat(url, "gpu-h100-02", heartbeat(gpus=8, hostname="gpu-h100-02", internal_ip="10.0.0.12"))
    ascend = [
        gpu_stat(
            i,
            vendor="ascend",
            model="Ascend 910B",
            memory_total_mb=65536,
            metrics_available=["utilization", "memory_used_mb"],
        )
        for i in range(8)
    ]
    for card in ascend:  # not read: absent, never null or 0
        del card["temperature"], card["power_w"]
    beat(
        url,
        "npu-910b-03",
        heartbeat(
            gpu_stats=ascend,
            hostname="npu-910b-03",
            internal_ip="10.0.0.13",
            inference_engines=["mindie"],
            inference_engine_versions={"mindie": "2.0"},
        ),
    )
    beat(url, "gpu-vega-04", heartbeat(gpus=2, hostname="gpu-vega-04", internal_ip="10.0.0.14"))
    for node_id, name in (
        ("gpu-a100-01", "a100-01"),
        ("gpu-h100-02", "h100-02"),
        ("npu-910b-03", "ascend-03"),
        ("gpu-vega-04", "vega-04"),
    ):
        Node.objects.filter(pk=node_id).update(name=name)
    vega_node = Node.objects.get(pk="gpu-vega-04")
    assign_tenant(vega_node, vega, expected_version=vega_node.version)
    backfill_history("gpu-h100-02", 8)
    backfill_server_samples()
    # another tenant's task, and alerts for each audience
    vega_task = create_task(tenant=vega, name="vega-secret-job", image="busybox", gpu_required=1)
    raise_alert(
        type=AlertType.QUOTA_EXCEEDED,
        severity=Severity.WARNING,
        scope=AlertScope.TENANT,
        key="quota:orbit",
        tenant_id=orbit.pk,
        message="Orbit Labs asked for 12 GPUs; its quota is 8.",
    )
    assert Alert.objects.filter(type=AlertType.GPU_LOST, node_id="gpu-a100-01", gpu_index=3).exists()
    return {
        "operator": operator,
        "member": member,
        "orbit": orbit,
        "vega": vega,
        "vega_task": vega_task,
        "last_beats": last_beats,
    }


def keep_alive(live) -> None:
    """Each node beats again as it last did: on a loaded machine the module can outlast
    the 45 s after which the scheduler gives a silent node up (apps/nodes/liveness.py)."""
    for node_id, payload in live["last_beats"].items():
        send_beat(live["url"], node_id, payload)


@pytest.fixture(scope="module")
def live(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), live_portal(build_cluster) as world:
        yield world


class Person:
    """A signed-in browser context of one user: it goes to pages and saves screenshots."""

    def __init__(self, live, username: str, role: str):
        self.url, self.role = live["url"], role
        self.context = live["browser"].new_context(viewport={"width": 1360, "height": 900}, base_url=live["url"])
        self.context.set_default_timeout(WAIT_MS)
        self.page = self.context.new_page()
        self.shots = 0
        self.page.goto("/portal/")
        sync_api.expect(self.page).to_have_url(re.compile(r"/portal/login/\?next="))
        self.page.fill("#id_username", username)
        self.page.fill("#id_password", PASSWORD)
        self.page.click("button[type=submit]")
        sync_api.expect(self.page.locator("#status-bar")).to_be_visible()

    def go(self, path: str):
        response = self.page.goto(path)
        return response.status

    def shot(self, name: str) -> Path:
        self.shots += 1
        path = SCREENSHOTS / f"{self.role}-{self.shots:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def close(self):
        self.context.close()


@pytest.fixture(scope="module")
def operator(live):
    person = Person(live, "ops", "operator")
    yield person
    person.close()


@pytest.fixture(scope="module")
def member(live):
    person = Person(live, "orbit-dev", "member")
    yield person
    person.close()


def status_numbers(page) -> dict:
    return {
        name: int(page.locator(f'[data-status="{name}"]').inner_text())
        for name in ("gpus-online", "tasks-running", "alerts-active")
    }


expect = sync_api.expect


# --- the operator ---------------------------------------------------------------------------------


def test_operator_dashboard_and_status_bar(operator):
    page = operator.page
    operator.go("/portal/")
    expect(page.locator("h1")).to_have_text("Welcome, ops")
    # 3 + 8 + 8 + 2 cards online, less none: a100-01's lost card is not online
    assert status_numbers(page) == {"gpus-online": 21, "tasks-running": 0, "alerts-active": 2}
    expect(page.locator('[data-dash="nodes"]')).to_have_text("4")
    operator.shot("dashboard")


def charts_drawn(page, chart: str) -> int:
    locator = page.locator(f'#{chart}[data-state="drawn"]')
    expect(locator).to_have_count(1)
    expect(locator.locator("canvas")).to_have_count(1)
    return int(locator.get_attribute("data-points"))


def test_operator_dashboard_server_panel(operator):
    page = operator.page
    this_host = hostmetrics.host_name()
    operator.go("/portal/")
    panel = page.locator("#server-panel")
    expect(panel).to_be_visible()
    # a set of cards per host, as stored; this host's newest sample is the machine's own
    expect(panel.locator(".host-card")).to_have_count(2)
    mine = panel.locator(f'.host-card[data-host="{this_host}"]')
    other = panel.locator(f'.host-card[data-host="{OTHER_HOST}"]')
    expect(mine.locator('[data-reading="cpu"]')).to_have_text(re.compile(r"^\d+%$"))
    expect(mine.locator('[data-detail="memory"]')).to_have_text(re.compile(r"^[\d.]+ [KMGT]iB / [\d.]+ [KMGT]iB$"))
    expect(mine.locator('[data-reading="temperature"]')).to_have_text(re.compile(r"^(\d+ °C|no sensor)$"))
    expect(other.locator('[data-reading="temperature"]')).to_have_text("no sensor")
    expect(other.locator('[data-reading="net-out"]')).to_have_text("↑ 29.3 KiB/s")  # 30,000 B/s
    expect(other.locator('[data-reading="uptime"]')).to_have_text("8 d 23 h 59 min")
    # 70 to 90 %: red above 80 (spec 003), with no amber step below it
    standby_cpu = other.locator('[data-reading="cpu"]')
    red = float(standby_cpu.inner_text().rstrip("%")) > 80
    expect(standby_cpu).to_have_class(re.compile(r"\bhigh\b" if red else r"\bok\b"))
    # the six-point health check and its verdict
    checks = panel.locator("#server-checks tr[data-check]")
    expect(checks).to_have_count(6)
    assert checks.evaluate_all("rows => rows.map(r => r.dataset.check)") == [
        "database",
        "storage",
        "scheduler",
        "gpu_nodes",
        "broker",
        "configuration",
    ]
    expect(panel.locator('#server-checks tr[data-check="database"] .badge')).to_have_text("ok")
    expect(panel.locator("[data-verdict]")).to_have_text(re.compile(r"^(healthy|degraded|unhealthy)$"))
    # the hour's charts, one line per host; the other host's silent quarter hour is a gap
    expect(panel.locator('#server-charts[data-hours="1"]')).to_have_count(1)
    assert 59 <= charts_drawn(page, "server-cpu") <= 61
    for chart in ("server-memory", "server-disk", "server-network", "server-load"):
        assert charts_drawn(page, chart) >= 59
    expect(panel.locator("#server-network")).to_have_attribute("data-series", "4")  # in and out, per host
    standby = sorted([this_host, OTHER_HOST]).index(OTHER_HOST)
    xs, *lines = page.evaluate("window.heteroflowServerPanel.chartData('server-cpu')")
    assert len(lines) == 2 and all(len(line) == len(xs) for line in lines)
    assert 0 not in lines[standby] and None in lines[standby][1:-2]  # a gap inside the hour, never a 0
    assert sum(v is None for v in lines[standby]) >= GAP_MINUTES[1] - GAP_MINUTES[0] - 1
    # the standby has no sensor: its temperature line is all gaps, not a line at 0 °C
    assert charts_drawn(page, "server-temperature") >= 59
    _xs, *temperatures = page.evaluate("window.heteroflowServerPanel.chartData('server-temperature')")
    assert set(temperatures[standby]) == {None} and 0 not in temperatures[1 - standby]
    operator.shot("dashboard-server-panel")

    # the range switch reads the history API with the session and redraws
    for hours, low, high in (("6", 70, 73), ("168", 160, 169), ("24", 94, 97)):
        with page.expect_response(
            lambda r, hours=hours: f"/api/v1/server/metrics/history?hours={hours}" in r.url
        ) as answer:
            page.click(f'[data-server-range="{hours}"]')
        assert answer.value.status == 200
        expect(panel.locator(f'#server-charts[data-hours="{hours}"]')).to_have_count(1)
        expect(panel.locator(f'[data-server-range="{hours}"]')).to_have_attribute("aria-current", "true")
        expect(page).to_have_url(re.compile(rf"\?hours={hours}"))
        assert low <= charts_drawn(page, "server-cpu") <= high
        expect(panel.locator("#server-cpu")).to_have_attribute("data-series", "2")
        if hours == "168":
            operator.shot("dashboard-server-panel-7d")

    # the 5 s refresh (called now): stored samples, the live reading of the host that
    # answered, the health check; the same six checks drawn by the script
    page.evaluate("window.heteroflowServerPanel.settled()")  # a poll of its own 5 s timer, if one is under way
    with page.expect_response(lambda r: r.url.endswith("/api/v1/server/metrics")) as live:
        page.evaluate("window.heteroflowServerPanel.refresh()")
    assert live.value.status == 200 and live.value.json()["host"] == this_host
    expect(mine).to_have_attribute("data-source", "live")
    expect(mine.locator('[data-field="stamp"]')).to_have_text("live")
    expect(mine.locator('[data-field="platform"]')).to_contain_text("answered the refresh")
    expect(other).to_have_attribute("data-source", "sample")
    expect(page.locator("#server-updated")).to_have_text(re.compile(r"^Cards and health check updated .*\.$"))
    expect(page.locator("#server-updated")).not_to_contain_text("Could not read")
    expect(checks).to_have_count(6)
    # a range the panel does not offer is refused
    assert operator.go("/portal/?hours=5") == 400
    expect(page.locator("[data-server-error]")).to_contain_text("not a range of the server panel")


def test_operator_nodes_search_open_and_edit_location(operator):
    page = operator.page
    operator.go("/portal/nodes/")
    expect(page.locator(".node-card")).to_have_count(4)
    expect(page.locator('[data-summary="lost"]')).to_have_text("1")
    expect(page.locator('[data-summary="total"]')).to_have_text("22")
    operator.shot("nodes")
    page.fill("#q", "A100")
    page.click(".toolbar button[type=submit]")
    expect(page.locator(".node-card")).to_have_count(1)
    page.click('.node-card[data-node="gpu-a100-01"]')
    expect(page).to_have_url(re.compile(r"/portal/nodes/gpu-a100-01/$"))
    expect(page.locator('tr[data-gpu="3"] .badge')).to_have_text("lost")
    page.fill("#region", "eu-north")
    page.fill("#zone", "az2")
    page.fill("#rack", "r42")
    page.click("#location-form button[type=submit]")
    expect(page.locator(".messages")).to_contain_text("Location saved.")
    expect(page.locator("[data-location]")).to_have_text("eu-north / az2 / r42")
    node = Node.objects.get(pk="gpu-a100-01")
    assert (node.region, node.zone, node.rack) == ("eu-north", "az2", "r42")
    operator.shot("node-detail")


def test_operator_node_monitor_switches_range_with_charts(operator):
    page = operator.page
    operator.go("/portal/nodes/monitor/?node=gpu-h100-02")
    assert charts_drawn(page, "chart-utilization") > 100  # an hour at 10 s buckets
    page.click('[data-range="6"]')
    expect(page.locator('[data-range="6"]')).to_have_attribute("aria-current", "true")
    six_hours = charts_drawn(page, "chart-utilization")
    assert 50 < six_hours < 400
    for chart in ("chart-memory", "chart-temperature", "chart-host", "chart-power"):
        assert charts_drawn(page, chart) > 50
    expect(page.locator('[data-energy="kwh"]')).not_to_have_text("—")
    # the energy section: power per card (8 cards), the node's total, the CPU estimate apart
    assert charts_drawn(page, "chart-power-cards") > 50
    expect(page.locator("#chart-power-cards")).to_have_attribute("data-series", "8")
    assert charts_drawn(page, "chart-power-node") > 50
    expect(page.locator("#chart-cpu-estimate h3")).to_have_text("CPU power (W, estimate)")
    expect(page.locator("#chart-cpu-estimate")).to_have_attribute("data-state", re.compile("drawn|empty"))
    page.select_option("#gpu", "3")
    expect(page).to_have_url(re.compile(r"gpu=3"))
    assert charts_drawn(page, "chart-utilization") == six_hours
    operator.shot("node-monitor")
    # auto-refresh reads the node's JSON with the session and redraws (the 90 s tick, called now)
    with page.expect_response(lambda r: "/api/v1/nodes/metrics/gpu-h100-02?hours=6" in r.url) as answer:
        page.evaluate("window.heteroflowMonitor.refresh()")
    assert answer.value.status == 200 and len(answer.value.json()["points"]) == six_hours
    expect(page.locator("#updated")).to_contain_text(f"{six_hours} points, 60 s each")
    # the Ascend cards report no temperature: "not supported", not a flat zero
    operator.go("/portal/nodes/monitor/?node=npu-910b-03")
    expect(page.locator('[data-live="temperature"]')).to_have_text("not supported")
    expect(page.locator('#chart-temperature[data-state="unsupported"]')).to_have_count(1)
    expect(page.locator('#chart-utilization[data-state="drawn"]')).to_have_count(1)


def test_operator_environment(operator):
    page = operator.page
    operator.go("/portal/environment/")
    expect(page.locator('[data-summary="nodes"]')).to_have_text("4")
    expect(page.locator('[data-summary="gpus-lost"]')).to_have_text("1")
    expect(page.locator("tr[data-node]")).to_have_count(4)
    operator.shot("environment")
    page.click('[data-tab="offline"]')
    expect(page.locator("tr[data-node]")).to_have_count(0)


def test_operator_resolves_the_lost_gpu_alert(operator):
    page = operator.page
    operator.go("/portal/alerts/?type=GPU_LOST")
    expect(page.locator("tr[data-alert]")).to_have_count(1)
    operator.shot("alerts")
    page.click("tr[data-alert] a")
    expect(page.locator("[data-alert-state]")).to_have_text("ACTIVE")
    page.click("button:has-text('Resolve')")
    expect(page.locator("[data-alert-state]")).to_have_text("RESOLVED")
    operator.shot("alert-detail")
    expect(page.locator('[data-status="alerts-active"]')).to_have_text("1")


# --- the tenant member ----------------------------------------------------------------------------


def test_member_dashboard_is_narrowed_to_the_tenant(member):
    page = member.page
    member.go("/portal/")
    expect(page.locator("main")).to_contain_text("Acting in tenant Orbit Labs as member")
    # shared nodes only (not vega-04), and no node or GPU alert
    assert status_numbers(page) == {"gpus-online": 19, "tasks-running": 0, "alerts-active": 1}
    # no server panel, and none of its data with this session
    expect(page.locator("#server-panel")).to_have_count(0)
    for path in (
        "/portal/server/hosts/",
        "/api/v1/server/metrics",
        "/api/v1/server/metrics/history?hours=1",
        "/api/v1/server/health-check",
    ):
        assert member.context.request.get(path).status == 403, path
    member.shot("dashboard")


def test_member_nodes_without_operator_tools(member):
    page = member.page
    member.go("/portal/nodes/")
    expect(page.locator(".node-card")).to_have_count(3)
    page.fill("#q", "910B")
    page.click(".toolbar button[type=submit]")
    expect(page.locator(".node-card")).to_have_count(1)
    member.shot("nodes")
    page.click(".node-card")
    expect(page.locator("h1")).to_contain_text("ascend-03")
    expect(page.locator("#location-form")).to_have_count(0)
    expect(page.locator("text=Delete node")).to_have_count(0)
    member.shot("node-detail")
    assert member.go("/portal/nodes/gpu-vega-04/") == 404


def test_member_node_monitor_and_environment(member):
    page = member.page
    member.go("/portal/nodes/monitor/?node=gpu-h100-02")
    page.click('[data-range="24"]')
    expect(page.locator('[data-range="24"]')).to_have_attribute("aria-current", "true")
    # an hour of history in 5-minute buckets
    assert 10 <= charts_drawn(page, "chart-utilization") <= 13
    assert 10 <= charts_drawn(page, "chart-host") <= 13
    member.shot("node-monitor")
    assert member.go("/portal/nodes/monitor/?node=gpu-vega-04") == 404
    member.go("/portal/environment/?tab=all")
    expect(page.locator("tr[data-node]")).to_have_count(3)
    member.shot("environment")


def test_member_submits_a_task_and_sees_it_scheduled(member, live):
    page = member.page
    member.go("/portal/tasks/new/")
    page.fill("#image", "busybox")
    page.fill("#gpu_required", "65")
    page.click("#task-form button[type=submit]")
    expect(page.locator('[data-errors="name"]')).to_have_text("This field may not be blank.")
    expect(page.locator('[data-errors="gpu_required"]')).to_have_text("Ensure this value is less than or equal to 64.")
    member.shot("task-form-errors")
    page.fill("#name", "finetune-qwen")
    page.fill("#gpu_required", "2")
    page.fill("#command", "python\ntrain.py\n--epochs=1")
    page.click("#task-form button[type=submit]")
    expect(page.locator("[data-task-status]")).to_have_text("pending")
    task_id = int(re.search(r"/portal/tasks/(\d+)/", page.url).group(1))
    keep_alive(live)
    wait_until(lambda: task_id in committed(run_cycle).bound, 20, "the task to be placed")
    task = Task.objects.select_related("node").get(pk=task_id)
    page.reload()
    expect(page.locator("[data-task-status]")).to_have_text("scheduled")
    expect(page.locator('[data-explanation="placed"]')).to_contain_text(task.node.name)
    member.shot("task-scheduled")
    member.go("/portal/tasks/")
    expect(page.locator(f'tr[data-task="{task_id}"]')).to_contain_text("scheduled")
    member.shot("tasks")


def test_member_acknowledges_an_alert(member):
    page = member.page
    member.go("/portal/alerts/")
    expect(page.locator("tr[data-alert]")).to_have_count(1)
    page.click("tr[data-alert] a")
    expect(page.locator("button:has-text('Resolve')")).to_have_count(0)  # tenant admins and operators only
    page.click("button:has-text('Acknowledge')")
    expect(page.locator("[data-alert-ack]")).to_contain_text("by orbit-dev")
    member.shot("alert-detail")


def test_member_creates_and_revokes_an_api_key(member):
    page = member.page
    member.go("/portal/keys/")
    page.fill("#key-name", "notebook")
    page.click("#key-form button[type=submit]")
    key = page.locator("[data-new-key]").inner_text()
    assert key.startswith("sk-tenant-")
    member.shot("api-key-created")
    answer = requests.get(f"{member.url}/api/v1/tasks", headers=bearer_http(key), timeout=10)
    assert answer.status_code == 200
    member.go("/portal/keys/")
    expect(page.locator("[data-new-key]")).to_have_count(0)  # shown once
    page.once("dialog", lambda dialog: dialog.accept())
    page.click('tr[data-key="notebook"] button:has-text("Revoke")')
    expect(page.locator('tr[data-key="notebook"]')).to_contain_text("revoked")
    member.shot("api-keys")
    answer = requests.get(f"{member.url}/api/v1/tasks", headers=bearer_http(key), timeout=10)
    assert answer.status_code == 401
    assert ApiKey.objects.get(name="notebook").revoked_at is not None


def test_member_cannot_open_another_tenants_task_until_switching(member, live):
    page = member.page
    vega_task = live["vega_task"].pk
    assert member.go(f"/portal/tasks/{vega_task}/") == 404
    expect(page.locator("h1")).to_have_text("Not found")
    member.shot("other-tenant-task-404")
    member.go("/portal/tasks/")
    expect(page.locator(f'tr[data-task="{vega_task}"]')).to_have_count(0)
    page.select_option("#tenant-switch", "vega")
    expect(page.locator("main")).to_contain_text("Acting in tenant Vega AI as viewer")
    member.go(f"/portal/tasks/{vega_task}/")
    expect(page.locator("h1")).to_contain_text("vega-secret-job")
    page.select_option("#tenant-switch", "orbit")
    expect(page.locator("main")).to_contain_text("Acting in tenant Orbit Labs as member")


def test_operator_sees_the_placed_task_on_the_nodes_page(operator):
    page = operator.page
    operator.go("/portal/nodes/")
    # the member's task holds two cards; the same cycle placed Vega's one-card task
    expect(page.locator('[data-summary="busy"]')).to_have_text("3")
    expect(page.locator('[data-summary="success-rate"]')).to_have_text("100.0%")
    expect(page.locator(".gpu-cell.busy")).to_have_count(3)
    tasks = [int(n) for n in page.locator("[data-tasks]").all_inner_texts()]
    assert sorted(tasks, reverse=True) == tasks == [1, 1, 0, 0]  # the default order: most tasks first
    operator.shot("nodes-busy")  # the README's picture
