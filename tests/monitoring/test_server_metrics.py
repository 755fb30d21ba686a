"""Control-plane host metrics: reading the host, storing samples per host with rates,
retention, the per-host guard, and the live and history endpoints."""

from collections import namedtuple
from datetime import UTC, datetime, timedelta

import pytest
import time_machine

from apps.core.guard import Outcome, per_host_key, run_periodic
from apps.core.models import JobRun
from apps.monitoring import hostmetrics, services
from apps.monitoring.models import ServerMetric
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db

Temp = namedtuple("shwtemp", "label current high critical")
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


# --- reading the host ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "chips,expected",
    [
        ({"coretemp": [Temp("Package id 0", 54.0, 80, 100), Temp("Core 0", 51.0, 80, 100)]}, 54.0),
        ({"acpitz": [Temp("", 27.8, None, None)], "k10temp": [Temp("Tctl", 61.25, None, None)]}, 61.25),
        ({"acpitz": [Temp("", 27.8, None, None)], "nvme": [Temp("Composite", 38.0, 80, 90)]}, None),  # not the CPU
        ({"coretemp": [Temp("Package id 0", 0.0, 80, 100)]}, None),  # a broken sensor, not a frozen CPU
        ({}, None),
    ],
)
def test_cpu_temperature_comes_from_a_cpu_sensor_or_is_none(chips, expected):
    assert hostmetrics.cpu_temperature(lambda: chips) == expected


def test_cpu_temperature_is_none_when_reading_sensors_fails():
    def denied():
        raise PermissionError("no access to /sys/class/hwmon")

    assert hostmetrics.cpu_temperature(denied) is None


def test_this_host_reads_a_temperature_or_none_never_zero():
    value = hostmetrics.cpu_temperature()
    assert value is None or value >= hostmetrics.MIN_PLAUSIBLE_CELSIUS


Times = namedtuple("scputimes", "user nice system idle iowait guest guest_nice")


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(round(seconds, 3))
        self.now += seconds


def test_cpu_sampler_measures_between_polls_and_waits_only_when_it_must():
    clock = FakeClock()
    readings = iter(
        [
            Times(10, 0, 10, 80, 0, 0, 0),  # first call: baseline...
            Times(15, 0, 15, 90, 0, 0, 0),  # ...then 1 s later: 10 busy of 20
            Times(45, 0, 15, 100, 0, 0, 0),  # 5 s after: 30 busy of 40
            Times(46, 0, 15, 100, 0, 0, 0),  # a poll 0.2 s after: waits 0.8 s
        ]
    )
    sampler = hostmetrics.CpuSampler(
        window=1.0, max_age=120, times=lambda: next(readings), clock=clock, sleep=clock.sleep
    )
    assert sampler.percent() == (50.0, 1.0)
    assert clock.slept == [1.0]
    clock.now += 5
    assert sampler.percent() == (75.0, 5.0)
    assert clock.slept == [1.0]  # no wait: the previous poll is the baseline
    clock.now += 0.2
    assert sampler.percent() == (100.0, 1.0)
    assert clock.slept == [1.0, 0.8]


def test_busy_fraction_does_not_count_guest_time_twice():
    before = Times(10, 0, 0, 90, 0, 0, 0)
    after = Times(20, 0, 0, 100, 0, 5, 0)  # 5 s of guest inside the 10 s of user
    assert hostmetrics.busy_fraction(before, after) == 0.5


def test_read_host_gives_real_readings():
    sample, window = hostmetrics.read_host(cpu=hostmetrics.CpuSampler(window=0.05))
    assert 0 <= sample.cpu_percent <= 100 and window >= 0.05
    assert sample.memory_total_bytes > 0 and 0 < sample.memory_percent < 100
    assert sample.disk_total_bytes > 0 and sample.net_recv_bytes >= 0 and sample.uptime_seconds > 0


@pytest.mark.parametrize(
    "previous,current,seconds,expected",
    [
        (1_000, 4_000, 30, 100.0),
        (None, 4_000, 30, None),  # no previous sample
        (5_000, 4_000, 30, None),  # counter went backwards: the host rebooted
        (1_000, 4_000, 0, None),
    ],
)
def test_byte_rate(previous, current, seconds, expected):
    assert hostmetrics.byte_rate(previous, T0, current, T0 + timedelta(seconds=seconds)) == expected


# --- storing samples -------------------------------------------------------------------------


def sample(**overrides):
    values = dict(
        cpu_percent=12.5,
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
        uptime_seconds=3600,
        cpu_temperature_celsius=None,
    )
    return hostmetrics.HostSample(**(values | overrides))


def test_samples_are_kept_per_host_with_rates_since_that_hosts_previous(settings):
    settings.HETEROFLOW_SERVER_METRICS_HOST = "cp-1"
    first = services.collect_server_metrics(T0, read=lambda: (sample(), 1.0))
    services.record_sample("cp-2", sample(net_recv_bytes=9_000_000_000), T0 + timedelta(seconds=10))
    second = services.collect_server_metrics(
        T0 + timedelta(seconds=30), read=lambda: (sample(net_recv_bytes=1_300_000, net_sent_bytes=560_000), 1.0)
    )
    rows = {row.pk: row for row in ServerMetric.objects.all()}
    assert rows[first].host == rows[second].host == "cp-1"
    assert rows[first].net_recv_bytes_per_second is None  # nothing to measure from
    assert rows[second].net_recv_bytes_per_second == 10_000.0  # cp-2's counter played no part
    assert rows[second].net_sent_bytes_per_second == 2_000.0
    assert rows[second].cpu_temperature_celsius is None


def test_the_collection_guard_is_per_host():
    key = "monitoring.collect_server_metrics"
    ran = []
    assert run_periodic(key, lambda: ran.append("a"), now=T0, host="cp-a").outcome == Outcome.RAN
    assert (
        run_periodic(key, lambda: ran.append("a2"), now=T0 + timedelta(seconds=5), host="cp-a").outcome == Outcome.EARLY
    )
    assert run_periodic(key, lambda: ran.append("b"), now=T0 + timedelta(seconds=5), host="cp-b").outcome == Outcome.RAN
    assert ran == ["a", "b"]
    assert set(JobRun.objects.filter(key__startswith=key).values_list("key", flat=True)) == {
        f"{key}@cp-a",
        f"{key}@cp-b",
    }


def test_a_long_host_name_still_fits_the_job_key():
    key = per_host_key("monitoring.collect_server_metrics", "h" * 200)
    assert len(key) <= 100 and key != per_host_key("monitoring.collect_server_metrics", "h" * 199)


def test_pruning_keeps_the_configured_retention(settings):
    settings.HETEROFLOW_SERVER_METRICS_RETENTION_HOURS = 24
    for age_hours in (1, 23, 25, 200):
        services.record_sample("cp-1", sample(), T0 - timedelta(hours=age_hours))
    assert services.prune_server_metrics(T0) == 2
    assert sorted(
        int((T0 - at).total_seconds() // 3600) for at in ServerMetric.objects.values_list("at", flat=True)
    ) == [1, 23]
    assert services.prune_server_metrics(T0, retention_hours=2) == 1


def test_collection_and_pruning_are_separate_periodic_jobs():
    from apps.core.guard import declared_jobs
    from heteroflow.beat import beat_schedule

    PERIODIC_JOBS = declared_jobs()

    collect, prune = (
        PERIODIC_JOBS["monitoring.collect_server_metrics"],
        PERIODIC_JOBS["monitoring.prune_server_metrics"],
    )
    assert (collect.every, collect.per_host) == (30.0, True)
    assert (prune.every, prune.per_host) == (3600.0, False)
    schedule = beat_schedule()
    assert "monitoring.prune_server_metrics" in schedule
    assert "monitoring.collect_server_metrics" not in schedule  # each worker sends it to its own host


def test_latest_samples_are_each_hosts_newest_within_the_hour():
    for host, minutes_ago in (("cp-1", 3), ("cp-1", 1), ("cp-2", 59), ("cp-3", 61), ("cp-0", -2)):
        services.record_sample(host, sample(cpu_percent=float(minutes_ago)), T0 - timedelta(minutes=minutes_ago))
    from apps.monitoring.selectors import latest_samples

    latest = latest_samples(now=T0)
    # by host; cp-3 silent for over an hour is gone; a sample dated after `now` is not "newest"
    assert [(row.host, row.cpu_percent) for row in latest] == [("cp-1", 1.0), ("cp-2", 59.0)]
    assert [row.host for row in latest_samples(now=T0, within=timedelta(minutes=2))] == ["cp-1"]


# --- the API ---------------------------------------------------------------------------------

SERVER_ENDPOINTS = [
    "/api/v1/server/metrics",
    "/api/v1/server/metrics/history",
    "/api/v1/server/health-check",
    "/api/v1/server/runtime",
]


@pytest.mark.parametrize("path", SERVER_ENDPOINTS)
@pytest.mark.parametrize(
    "who,expected",
    [
        ("anonymous", 401),
        ("agent", 403),
        ("acme-admin", 403),
        ("acme-viewer", 403),
        ("operator", 200),
    ],
)
def test_server_endpoints_are_for_platform_operators_only(world, api, settings, path, who, expected):
    fixed = {"anonymous": {}, "agent": AGENT, "operator": bearer(world.operator_key)}
    headers = fixed[who] if who in fixed else bearer(world.keys[who])
    response = api.get(path, **headers)
    assert response.status_code == expected, response.content
    if expected != 200:
        assert set(response.json()["error"]) == {"code", "message", "fields"}


def test_a_tenant_admin_session_is_not_a_platform_operator(world, api):
    api.force_login(world.users["acme-admin"])
    assert api.get("/api/v1/server/metrics").status_code == 403
    api.force_login(world.operator)
    assert api.get("/api/v1/server/metrics").status_code == 200


def test_live_metrics_describe_this_host(world, api, settings):
    settings.HETEROFLOW_SERVER_METRICS_HOST = "cp-live"
    previous = timezone_now_minus(30)
    services.record_sample("cp-live", sample(net_recv_bytes=0, net_sent_bytes=0), previous)
    body = api.get("/api/v1/server/metrics", **bearer(world.operator_key)).json()
    assert body["host"] == "cp-live" and body["os"] and body["arch"]
    assert 0 <= body["cpu_percent"] <= 100 and body["cpu_window_seconds"] > 0
    assert body["memory_total_bytes"] > 0 and body["uptime_seconds"] > 0
    assert body["net_recv_bytes"] >= 0 and body["net_recv_bytes_per_second"] is not None
    assert body["net_rate_since"] is not None
    assert "cpu_temperature_celsius" in body and body["cpu_temperature_celsius"] != 0


def timezone_now_minus(seconds):
    from apps.core.clock import utcnow

    return utcnow() - timedelta(seconds=seconds)


@pytest.mark.parametrize("hours,bucket", [(1, 60), (6, 300), (24, 900), (168, 3600), (2, 300), (12, 900), (48, 3600)])
def test_history_buckets(world, api, hours, bucket):
    now = T0
    for host in ("cp-1", "cp-2"):
        at = now - timedelta(hours=hours)
        while at <= now:
            services.record_sample(host, sample(cpu_percent=10.0 if host == "cp-1" else 90.0), at)
            at += timedelta(seconds=30 if hours <= 6 else 600)
    with time_machine.travel(now, tick=False):
        body = api.get(f"/api/v1/server/metrics/history?hours={hours}", **bearer(world.operator_key)).json()
    assert body["hours"] == hours and body["bucket_seconds"] == bucket
    series = {item["host"]: item["points"] for item in body["hosts"]}
    assert set(series) == {"cp-1", "cp-2"}
    for host, points in series.items():
        starts = [datetime.fromisoformat(point["at"].replace("Z", "+00:00")) for point in points]
        assert all(int(start.timestamp()) % bucket == 0 for start in starts)
        assert all(b - a == timedelta(seconds=bucket) for a, b in zip(starts, starts[1:]))
        assert hours * 3600 / bucket <= len(points) <= hours * 3600 / bucket + 1
        # each host has its own curve: the two never blend
        assert {point["cpu_percent"] for point in points} == {10.0 if host == "cp-1" else 90.0}
        assert all(point["cpu_temperature_celsius"] is None for point in points)


def test_history_of_one_host(world, api):
    services.record_sample("cp-1", sample(), timezone_now_minus(60))
    services.record_sample("cp-2", sample(), timezone_now_minus(60))
    body = api.get("/api/v1/server/metrics/history?hours=1&host=cp-2", **bearer(world.operator_key)).json()
    assert [item["host"] for item in body["hosts"]] == ["cp-2"]


@pytest.mark.parametrize("query", ["hours=0", "hours=169", "hours=-1", "hours=abc", "hours=1.5", "hours=1&colour=red"])
def test_history_refuses_what_it_cannot_serve(world, api, query):
    response = api.get(f"/api/v1/server/metrics/history?{query}", **bearer(world.operator_key))
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid" and error["fields"]


def test_history_defaults_to_one_hour(world, api):
    body = api.get("/api/v1/server/metrics/history", **bearer(world.operator_key)).json()
    assert (body["hours"], body["bucket_seconds"]) == (1, 60)


def test_runtime_diagnostics(world, api):
    body = api.get("/api/v1/server/runtime", **bearer(world.operator_key)).json()
    assert body["pid"] > 0 and body["memory"]["rss_bytes"] > 0
    assert body["threads"]["os"] >= 1 and "MainThread" in body["threads"]["python"]
    assert len(body["gc"]["counts"]) == 3


def test_each_worker_sends_the_per_host_jobs_to_its_own_host_queue(settings):
    from apps.monitoring.processes import PerHostJobs

    settings.HETEROFLOW_SERVER_METRICS_HOST = "cp-9"
    sent, repeating = [], []

    class App:
        def send_task(self, name, **options):
            sent.append((name, options))

    class Timer:
        def call_repeatedly(self, every, call):
            repeating.append((every, call))
            return type("Entry", (), {"cancel": lambda self: repeating.clear()})()

    worker = type("Worker", (), {"app": App(), "timer": Timer()})()
    step = PerHostJobs(worker)
    step.start(worker)
    expected = ("monitoring.collect_server_metrics", {"queue": "heteroflow.host.cp-9", "expires": 30.0})
    assert sent == [expected]  # at once, so a new host has a sample right away
    assert [every for every, _ in repeating] == [30.0]
    repeating[0][1]()
    assert sent == [expected, expected]
    step.stop(worker)
    assert repeating == []
