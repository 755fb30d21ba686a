"""The dashboard's server monitoring panel: platform operators see each control-plane
host's cards (its newest stored sample), the range's history per host and the six-point
health check; tenant users get neither the panel nor the data it reads. The samples are
written through the monitoring service that stores host samples (with the rates since
each host's previous one), over the past two hours."""

import json
import re
from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.monitoring import checks, hostmetrics, selectors, services
from apps.monitoring.models import ServerMetric
from apps.portal.templatetags.portal import byte_rate, bytes_iec, duration, level
from tests.portal.client import page

pytestmark = pytest.mark.django_db

SIX = ["database", "storage", "scheduler", "gpu_nodes", "broker", "configuration"]
UPTIME = 2 * 86400 + 3 * 3600 + 4 * 60  # "2 d 3 h 4 min"


def reading(**overrides):
    values = dict(
        cpu_percent=30.0,
        memory_percent=40.0,
        memory_used_bytes=4 << 30,
        memory_total_bytes=10 << 30,
        disk_percent=30.0,
        disk_used_bytes=30 << 30,
        disk_total_bytes=100 << 30,
        load_1=0.5,
        load_5=0.4,
        load_15=0.3,
        net_recv_bytes=1_000_000,
        net_sent_bytes=500_000,
        uptime_seconds=UPTIME,
        cpu_temperature_celsius=None,
    )
    return hostmetrics.HostSample(**(values | overrides))


@pytest.fixture(scope="module")
def samples(world, django_db_blocker):
    """cp-1 (a CPU sensor) and cp-2 (none, and no samples from 50 to 35 minutes ago) every
    30 s for two hours; cp-stale last sampled 5 minutes ago; cp-old 3 hours ago. Written
    once for the module, inside the module's transaction (see `world`), which the tests
    only read."""
    with django_db_blocker.unblock():
        return write_samples(utcnow())


def write_samples(now):
    for step in range(240, -1, -1):
        at = now - timedelta(seconds=30 * step)
        done = 240 - step
        # 30 KiB received and 3 KiB sent every 30 s: 1 KiB/s and 102.4 B/s
        counters = dict(net_recv_bytes=1_000_000 + done * 30_720, net_sent_bytes=500_000 + done * 3_072)
        services.record_sample("cp-1", reading(cpu_temperature_celsius=54.0, **counters), at)
        if not 70 <= step < 100:
            services.record_sample("cp-2", reading(cpu_percent=95.0, **counters), at)
    services.record_sample("cp-stale", reading(), now - timedelta(minutes=5))
    services.record_sample("cp-old", reading(), now - timedelta(hours=3))
    return now


def signed_in(client, user):
    client.force_login(user)
    return client


def card(html: str, host: str) -> str:
    found = re.search(rf'<article class="host-card[^"]*" data-host="{re.escape(host)}".*?</article>', html, re.S)
    assert found, f"no card for {host}"
    return found.group(0)


def reading_of(card_html: str, name: str) -> str:
    return re.search(rf'data-reading="{name}"[^>]*>([^<]*)<', card_html).group(1)


def panel_data(html: str) -> dict:
    return json.loads(
        re.search(r'<script id="server-panel-data" type="application/json">(.*?)</script>', html, re.S).group(1)
    )


def test_operators_see_each_hosts_cards_the_history_and_the_health_check(client, world, samples):
    response = signed_in(client, world.operator).get("/portal/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="server-panel"' in html and 'data-server-range="1" aria-current="true"' in html
    this_host = hostmetrics.host_name()
    hosts = re.findall(r'<article class="host-card[^"]*" data-host="([^"]+)" data-source="([a-z]+)"', html)
    # a card per host sampled within the hour, by name; cp-old has been silent for three
    # hours. The host serving the page has no stored sample here: its cards wait for the
    # live reading.
    assert hosts == [("cp-1", "sample"), ("cp-2", "sample"), ("cp-stale", "sample"), (this_host, "none")]

    one = card(html, "cp-1")
    assert reading_of(one, "cpu") == "30%" and reading_of(one, "memory") == "40%" and reading_of(one, "disk") == "30%"
    assert "4.0 GiB / 10.0 GiB" in one and "30.0 GiB / 100.0 GiB" in one
    assert reading_of(one, "net-in") == "↓ 1.0 KiB/s" and reading_of(one, "net-out") == "↑ 102 B/s"
    assert reading_of(one, "temperature") == "54 °C"
    assert reading_of(one, "load") == "0.50" and "5 min 0.40 · 15 min 0.30" in one
    assert reading_of(one, "uptime") == "2 d 3 h 4 min"
    assert "sampled 0 s ago" in one or re.search(r"sampled \d+ s ago", one)
    two = card(html, "cp-2")
    assert reading_of(two, "temperature") == "no sensor"  # null: no sensor, never 0 °C
    assert 'class="value high" data-reading="cpu">95%' in two
    stale = card(html, "cp-stale")
    assert stale.startswith('<article class="host-card stale"') and "no sample for 5 min" in stale
    assert reading_of(stale, "net-in") == "↓ —"  # its first sample: no rate to measure, not 0
    waiting = card(html, this_host)
    assert "no sample stored yet" in waiting and reading_of(waiting, "cpu") == "—"

    # the six checks with status and message, and the verdict, as the health check says
    expected = checks.run_all()
    rows = re.findall(
        r'<tr data-check="([a-z_]+)" data-check-status="([a-z]+)"><td><span class="badge [a-z]+">[a-z]+</span></td>'
        r"<td>[^<]+</td><td>([^<]+)</td>",
        html,
    )
    assert [(name, status) for name, status, _ in rows] == [(c["name"], c["status"]) for c in expected["checks"]]
    assert [name for name, _, _ in rows] == SIX and all(message.strip() for _, _, message in rows)
    assert f'data-verdict="{expected["status"]}"' in html
    scheduler = dict((name, message) for name, _, message in rows)["scheduler"]
    assert scheduler == "No scheduler cycle finished in the last 15 s."  # no beat in this test

    # the history the charts draw is the API's for the same range, one series per host
    data = panel_data(html)
    assert data["hours"] == 1 and data["this_host"] == this_host
    assert data["urls"] == {
        "live": "/api/v1/server/metrics",
        "history": "/api/v1/server/metrics/history",
        "health": "/api/v1/server/health-check",
        "hosts": "/portal/server/hosts/",
    }
    api = client.get("/api/v1/server/metrics/history?hours=1").json()
    series = {item["host"]: item["points"] for item in data["history"]["hosts"]}
    assert set(series) == {item["host"] for item in api["hosts"]} == {"cp-1", "cp-2", "cp-stale"}
    assert data["history"]["bucket_seconds"] == api["bucket_seconds"] == 60
    assert 59 <= len(series["cp-1"]) <= 61
    # cp-2's quarter hour without samples is missing, not a run of zeros
    assert len(series["cp-2"]) <= len(series["cp-1"]) - 14
    assert all(point["cpu_percent"] == 95.0 for point in series["cp-2"])
    assert all(point["cpu_temperature_celsius"] is None for point in series["cp-2"])

    # without JavaScript: the range's averages and peaks per host
    summary = dict(re.findall(r'<tr data-summary-host="([^"]+)">(.*?)</tr>', html, re.S))
    assert set(summary) == {"cp-1", "cp-2", "cp-stale"}
    assert "30% / 30%" in summary["cp-1"] and "54 °C" in summary["cp-1"] and "1.0 KiB/s" in summary["cp-1"]
    assert "95% / 95%" in summary["cp-2"] and "no sensor" in summary["cp-2"]


def level_of(card_html: str, name: str) -> str:
    return re.search(rf'class="value ([a-z]+)" data-reading="{name}"', card_html).group(1)


def test_the_cards_colours_follow_spec_003_and_the_script_gets_the_same_limits(client, world, samples):
    """CPU and memory red above 80 %, disk above 90 %, with no amber step; temperature
    amber above 60 °C and red above 80 °C."""
    now = utcnow()
    services.record_sample(
        "cp-hot",
        reading(cpu_percent=80.5, memory_percent=80.0, disk_percent=90.5, cpu_temperature_celsius=65.0),
        now,
    )
    services.record_sample(
        "cp-warm",
        reading(cpu_percent=79.0, memory_percent=81.0, disk_percent=89.0, cpu_temperature_celsius=81.0),
        now,
    )
    html = page(signed_in(client, world.operator), "/portal/")
    hot, warm = card(html, "cp-hot"), card(html, "cp-warm")
    assert [level_of(hot, name) for name in ("cpu", "memory", "disk", "temperature")] == ["high", "ok", "high", "warn"]
    assert [level_of(warm, name) for name in ("cpu", "memory", "disk", "temperature")] == ["ok", "high", "ok", "high"]
    assert level_of(card(html, "cp-1"), "cpu") == "ok"  # 30 %
    data = panel_data(html)
    assert data["thresholds"] == {
        "cpu_percent": "80",
        "memory_percent": "80",
        "disk_percent": "90",
        "cpu_temperature_celsius": "60,80",
    }
    # polled every 5 s, as the toggle says; the stale mark is there, hidden until a poll fails
    assert data["refresh_seconds"] == 5 and "Auto-refresh (5 s)" in html
    assert '<span class="server-stale" id="server-stale" role="status" hidden></span>' in html


@pytest.mark.parametrize(
    ("value", "limits", "expected"),
    [
        (None, "80", "none"),
        (80.0, "80", "ok"),
        (80.1, "80", "high"),
        (60.0, "60,80", "ok"),
        (60.5, "60,80", "warn"),
        (80.0, "60,80", "warn"),
        (80.5, "60,80", "high"),
    ],
)
def test_the_level_filter_with_one_or_two_limits(value, limits, expected):
    assert level(value, limits) == expected


def test_the_hosts_json_the_refresh_reads(client, world, samples):
    response = signed_in(client, world.operator).get("/portal/server/hosts/")
    assert response.status_code == 200 and "no-cache" in response["Cache-Control"]
    body = response.json()
    assert body["this_host"] == hostmetrics.host_name() and body["stale_after_seconds"] == 90
    assert [(host["host"], host["stale"]) for host in body["hosts"]] == [
        ("cp-1", False),
        ("cp-2", False),
        ("cp-stale", True),
    ]
    newest = ServerMetric.objects.filter(host="cp-1").order_by("-at").first()
    one = body["hosts"][0]
    assert (one["cpu_percent"], one["cpu_temperature_celsius"], one["uptime_seconds"]) == (30.0, 54.0, UPTIME)
    assert one["net_recv_bytes_per_second"] == newest.net_recv_bytes_per_second == 1024.0
    assert body["hosts"][1]["cpu_temperature_celsius"] is None
    assert body["hosts"][2]["net_recv_bytes_per_second"] is None and body["hosts"][2]["age_seconds"] >= 300


@pytest.mark.parametrize(
    "hours,bucket,hosts",
    [
        ("6", 300, {"cp-1", "cp-2", "cp-stale", "cp-old"}),
        ("24", 900, {"cp-1", "cp-2", "cp-stale", "cp-old"}),
        ("168", 3600, {"cp-1", "cp-2", "cp-stale", "cp-old"}),
    ],
)
def test_the_range_switch_without_javascript(client, world, samples, hours, bucket, hosts):
    html = signed_in(client, world.operator).get(f"/portal/?hours={hours}").content.decode()
    assert f'data-server-range="{hours}" aria-current="true"' in html
    assert html.count('aria-current="true"') == 1  # only the chosen range
    data = panel_data(html)
    assert (data["hours"], data["history"]["bucket_seconds"]) == (int(hours), bucket)
    assert {series["host"] for series in data["history"]["hosts"]} == hosts
    # the cards do not depend on the range: cp-old is still gone
    assert 'data-host="cp-old"' not in html


@pytest.mark.parametrize("hours", ["5", "2", "0", "169", "abc", "1.5", "", "-1"])
def test_the_range_switch_refuses_a_range_it_does_not_offer(client, world, samples, hours):
    response = signed_in(client, world.operator).get("/portal/", {"hours": hours})
    assert response.status_code == 400
    html = response.content.decode()
    error = re.search(r"<p class=\"error\" role=\"alert\" data-server-error>([^<]+)</p>", html).group(1)
    assert error.startswith("hours: &#x27;") and "choose one of 1 (1 h), 6 (6 h), 24 (24 h), 168 (7 d)" in error
    # refused, not quietly drawn for another range; the ranges it offers are still there
    assert 'id="server-panel-data"' not in html and 'data-host="' not in html
    assert 'href="?hours=6#server-panel"' in html
    assert "Welcome, op" in html  # the rest of the dashboard still answers


@pytest.mark.parametrize("who", ["acme-admin", "acme-member", "beta-viewer"])
def test_tenant_users_get_neither_the_panel_nor_its_data(client, world, samples, who):
    signed_in(client, world.users[who])
    response = client.get("/portal/?hours=6")
    assert response.status_code == 200  # the range means nothing without the panel
    html = response.content.decode()
    assert 'id="server-panel"' not in html and "server-panel-data" not in html and 'data-host="' not in html
    assert "server_panel.js" not in html and "uPlot" not in html
    hosts = client.get("/portal/server/hosts/")
    assert hosts.status_code == 403 and hosts.json()["error"]["code"] == "permission_denied"
    for url in ("/api/v1/server/metrics", "/api/v1/server/metrics/history?hours=1", "/api/v1/server/health-check"):
        answer = client.get(url)
        assert answer.status_code == 403, url
        assert answer.json()["error"]["code"] == "permission_denied"


def test_an_anonymous_visitor_is_sent_to_sign_in_for_the_hosts_json(client):
    response = client.get("/portal/server/hosts/")
    assert response.status_code == 302 and response["Location"].startswith("/portal/login/?next=")


def test_the_dashboard_does_no_panel_work_for_others_and_no_live_reading_for_anyone(
    client, world, samples, monkeypatch
):
    def forbidden(*args, **kwargs):
        raise AssertionError("the dashboard did the panel's work")

    for module, name in ((checks, "run_all"), (selectors, "history"), (selectors, "latest_samples")):
        monkeypatch.setattr(module, name, forbidden)
    assert signed_in(client, world.users["acme-admin"]).get("/portal/").status_code == 200
    monkeypatch.undo()
    # the live reading measures the CPU for up to a second: the page never waits for it
    monkeypatch.setattr(hostmetrics, "read_host", forbidden)
    assert signed_in(client, world.operator).get("/portal/").status_code == 200


@pytest.mark.parametrize(
    "value,expected",
    [
        (None, "—"),
        ("", "—"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (4 << 30, "4.0 GiB"),
        (3 << 40, "3.0 TiB"),
    ],
)
def test_bytes_are_shown_in_binary_units(value, expected):
    assert bytes_iec(value) == expected
    assert byte_rate(value) == (expected if expected == "—" else expected + "/s")


@pytest.mark.parametrize(
    "seconds,expected",
    [
        (None, "—"),
        (0, "0 s"),
        (59, "59 s"),
        (60, "1 min"),
        (3600, "1 h 0 min"),
        (UPTIME, "2 d 3 h 4 min"),
        (86400, "1 d 0 h 0 min"),
    ],
)
def test_durations(seconds, expected):
    assert duration(seconds) == expected
