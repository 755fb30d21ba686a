"""/metrics: the exposition parses, carries every documented metric, counts what
happens, computes the cluster snapshot (skipping a part that fails), answers only
allowed peers judged on the TCP address, and the shipped rules and dashboard name only
metrics it exposes."""

import asyncio
import json
import re
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from apps.core.clock import utcnow
from apps.core.models import JobRun
from apps.monitoring import access, selectors
from apps.nodes.models import Gpu
from apps.scheduler import quotas
from apps.scheduler.jobs import tick_job
from apps.scheduler.models import GpuAllocation
from apps.tasks.models import Task
from tests.factories import make_alert, make_node, make_task

pytestmark = pytest.mark.django_db

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy/prometheus/heteroflow-rules.yml"
DASHBOARD = REPO / "deploy/grafana/heteroflow-dashboard.json"
DOCS = REPO / "docs/monitoring.md"
# Series Prometheus adds itself for every target; never in an exposition.
PROMETHEUS_OWN = {"up"}


def scrape(client, **extra):
    response = client.get("/metrics", **extra)
    assert response.status_code == 200, response.content
    return response.content.decode()


def families(text) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def exposed_names(text) -> set[str]:
    """Every name a query may use: family names and their sample names (_total,
    _bucket, _sum, _count), also for families with no sample yet."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ())
        names.update(family.name + suffix for suffix in suffixes)
    return names


def value(fams, name, **labels):
    family_name = name.removesuffix("_total")
    for sample in fams[family_name].samples:
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None


PROMQL_WORDS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "rate",
    "irate",
    "increase",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "histogram_quantile",
    "clamp_min",
    "clamp_max",
    "time",
    "label_values",
    "abs",
    "topk",
    "bottomk",
    "delta",
    "deriv",
    "vector",
    "scalar",
}


def promql_metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    expr = re.sub(r"\$\w+", " ", expr)  # Grafana variables
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = match.group()
        following = expr[match.end() :].lstrip()[:1]
        if word in PROMQL_WORDS or following == "(" or re.fullmatch(r"\d+[smhdwy]|e\d+", word):
            continue
        names.add(word)
    return names


def documented_metrics() -> set[str]:
    """The names in the metric tables of docs/monitoring.md (rows starting `| \\`name\\``)."""
    return set(re.findall(r"^\| `((?:heteroflow|django|process|python)_[a-z0-9_]+)`", DOCS.read_text(), re.MULTILINE))


# --- the exposition -------------------------------------------------------------------------


def test_metrics_parse_and_carry_every_documented_metric(client):
    text = scrape(client)
    names = exposed_names(text)
    documented = documented_metrics()
    assert len(documented) >= 30, documented
    assert documented <= names, sorted(documented - names)


def test_every_heteroflow_metric_is_documented(client):
    documented = documented_metrics()
    undocumented = [
        name
        for name in families(scrape(client))
        if name.startswith("heteroflow_") and name not in documented and f"{name}_total" not in documented
    ]
    assert not undocumented


def test_metric_names_follow_prometheus_conventions(client):
    for family in text_string_to_metric_families(scrape(client)):
        if not family.name.startswith("heteroflow_"):
            continue
        assert re.fullmatch(r"[a-z][a-z0-9_]*", family.name), family.name
        if family.type == "gauge":
            assert not family.name.endswith("_total"), family.name  # _total is for counters
        if "seconds" in family.name or "bytes" in family.name:
            assert family.name.endswith(("_seconds", "_bytes")) or "_seconds_" in family.name, family.name
        for sample in family.samples:
            assert set(sample.labels) <= {
                "le",
                "reason",
                "job",
                "outcome",
                "task",
                "status",
                "gpu_type",
                "state",
                "type",
                "severity",
                "part",
                # heteroflow_agent_fields_ignored: the channel, and the field name (bounded:
                # the first 64 names, then "other")
                "channel",
                "field",
                "endpoint",  # the gateway's: chat, completions, embeddings, models
                "backend",  # the gateway's backends, from the database (never a request's)
                "kind",  # the gateway's tokens: prompt, completion
                "mode",  # the gateway's limits while Redis is away: local, closed, open
                "tenant",  # queues (docs/queues.md): the tenants with a queue, from the database
            }, (family.name, sample.labels)


def test_the_standard_process_and_python_collectors_are_there(client):
    names = exposed_names(scrape(client))
    assert {
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "python_info",
        "python_gc_objects_collected_total",
    } <= names


def test_django_request_and_database_metrics_count(client, world):
    client.get("/api/v1/tenants")  # 401, still a request
    fams = families(scrape(client))
    assert value(fams, "django_http_requests_total_by_method_total", method="GET") >= 1
    assert value(fams, "django_db_execute_total", alias="default", vendor="postgresql") >= 1


def test_openmetrics_is_served_when_asked(client):
    response = client.get("/metrics", HTTP_ACCEPT="application/openmetrics-text; version=1.0.0")
    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.decode().rstrip().endswith("# EOF")


# --- the cluster snapshot ---------------------------------------------------------------------


def test_the_snapshot_counts_the_cluster(client, world):
    acme = world.tenants["acme"]
    make_node("n1", 4)
    make_node("n2", 2, status="offline")
    make_node("a1", 1, vendor="ascend")
    make_node("cpu", 0)
    make_node("odd", 1, vendor="made-up-vendor")
    Gpu.objects.filter(node_id="n1", index=3).update(lost_at=utcnow())
    running = make_task(acme, name="r", status="running", node_id="n1", gpu_required=1)
    GpuAllocation.objects.create(task=running, node_id="n1", gpu_index=0, tenant=acme)
    old = make_task(acme, name="p1")
    Task.objects.filter(pk=old.pk).update(created_at=utcnow() - timedelta(minutes=10))
    make_task(acme, name="p2")
    make_alert(type="NODE_OFFLINE", severity="critical", key="node:n2", node_id="n2", message="m")
    make_alert(type="GPU_LOST", severity="warning", key="gpu:n1:3", node_id="n1", message="m")
    make_alert(type="GPU_LOST", severity="warning", key="gpu:n1:2", node_id="n1", message="m", state="RECOVERED")
    JobRun.objects.create(key="scheduler.tick", last_started_at=utcnow(), last_finished_at=utcnow(), last_outcome="ran")
    JobRun.objects.create(
        key="monitoring.collect_server_metrics@cp-1",
        last_finished_at=utcnow() - timedelta(minutes=1),
        last_outcome="ran",
    )
    JobRun.objects.create(key="alerts.sweep", last_finished_at=utcnow(), last_outcome="failed")

    fams = families(scrape(client))
    assert value(fams, "heteroflow_nodes", status="online", gpu_type="nvidia") == 1
    assert value(fams, "heteroflow_nodes", status="offline", gpu_type="nvidia") == 1
    assert value(fams, "heteroflow_nodes", status="online", gpu_type="none") == 1
    assert value(fams, "heteroflow_nodes", status="online", gpu_type="other") == 1  # never the raw value
    assert value(fams, "heteroflow_gpus", gpu_type="nvidia", state="available") == 4
    assert value(fams, "heteroflow_gpus", gpu_type="nvidia", state="busy") == 1
    assert value(fams, "heteroflow_gpus", gpu_type="nvidia", state="lost") == 1
    assert value(fams, "heteroflow_gpus", gpu_type="ascend", state="available") == 1
    assert value(fams, "heteroflow_alerts_active", type="NODE_OFFLINE", severity="critical") == 1
    assert value(fams, "heteroflow_alerts_active", type="GPU_LOST", severity="warning") == 1
    assert value(fams, "heteroflow_alerts_active", type="TASK_FAILED", severity="error") == 0
    assert value(fams, "heteroflow_tasks", status="pending") == 2
    assert value(fams, "heteroflow_tasks", status="running") == 1
    assert value(fams, "heteroflow_scheduler_pending_tasks") == 2
    assert 600 <= value(fams, "heteroflow_scheduler_oldest_pending_task_age_seconds") < 700
    assert value(fams, "heteroflow_scheduler_running") == 1
    last = {s.labels["job"]: s.value for s in fams["heteroflow_periodic_job_last_success_timestamp_seconds"].samples}
    assert set(last) == {"scheduler.tick", "monitoring.collect_server_metrics"}  # a failed run is no success
    assert all(
        value(fams, "heteroflow_metrics_snapshot_up", part=part) == 1
        for part in ("nodes", "gpus", "alerts", "queue", "scheduler", "gateway", "queues")
    )


def test_the_queues_gauges_say_each_tenants_nominal_use_borrowing_and_lending(client, world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    quotas.set_queue(acme, cohort="lab", weight=1.0, quotas=[quotas.QuotaInput("nvidia", 1)])
    quotas.set_queue(beta, cohort="lab", weight=1.0, quotas=[quotas.QuotaInput("nvidia", 3)])
    make_node("n1", 4)
    for card in (0, 1):
        task = make_task(acme, name=f"r{card}", status="running", node_id="n1", gpu_required=1)
        GpuAllocation.objects.create(task=task, node_id="n1", gpu_index=card, tenant=acme)
    fams = families(scrape(client))
    assert value(fams, "heteroflow_queue_nominal_gpus", tenant="acme", gpu_type="nvidia") == 1
    assert value(fams, "heteroflow_queue_used_gpus", tenant="acme", gpu_type="nvidia") == 2
    assert value(fams, "heteroflow_queue_borrowed_gpus", tenant="acme", gpu_type="nvidia") == 1
    assert value(fams, "heteroflow_queue_lent_gpus", tenant="beta", gpu_type="nvidia") == 1
    assert value(fams, "heteroflow_queue_used_gpus", tenant="beta", gpu_type="nvidia") == 0


def test_the_gateways_requests_in_flight_per_backend_come_from_its_redis_counts(client, settings):
    """The least-connections counts of every gateway process, at scrape time; a request
    whose process died (older than the concurrency TTL) is not counted."""
    import time

    import redis

    from apps.gateway.limits import conns_key

    connection = redis.Redis.from_url(settings.REDIS_URL)
    now_ms = int(time.time() * 1000)
    alive, quiet = conns_key("http://10.9.9.1:8000"), conns_key("http://10.9.9.2:8000")
    stale_ms = now_ms - (settings.HETEROFLOW_GATEWAY_CONCURRENCY_TTL_SECONDS + 60) * 1000
    connection.zadd(alive, {"r1": now_ms, "r2": now_ms - 1000, "dead": stale_ms})
    connection.zadd(quiet, {"dead": stale_ms})
    try:
        fams = families(client.get("/metrics").content.decode())
        assert value(fams, "heteroflow_gateway_backend_in_flight", backend="http://10.9.9.1:8000") == 2
        samples = {s.labels["backend"] for s in fams["heteroflow_gateway_backend_in_flight"].samples}
        assert "http://10.9.9.2:8000" not in samples
    finally:
        connection.delete(alive, quiet)


def test_a_snapshot_part_that_fails_is_left_out_not_a_500(client, monkeypatch):
    make_node("n1", 2)
    monkeypatch.setattr(selectors, "GPU_STATES_SQL", "SELECT vendor, state, count(*) FROM no_such_table GROUP BY 1, 2")
    response = client.get("/metrics")
    assert response.status_code == 200
    fams = families(response.content.decode())
    assert "heteroflow_gpus" not in fams
    assert value(fams, "heteroflow_metrics_snapshot_up", part="gpus") == 0
    # the parts after it still ran, in the same transaction
    assert value(fams, "heteroflow_nodes", status="online", gpu_type="nvidia") == 1
    assert value(fams, "heteroflow_metrics_snapshot_up", part="scheduler") == 1


# --- counters -------------------------------------------------------------------------------------


def sample_value(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_rejected_heartbeats_are_counted_by_reason(agents, client):
    """Rejections only: an applied beat commits on the route's own connection, so that
    one is counted in test_live_processes.py, whose tests clean up after themselves."""
    before = {
        "received": sample_value("heteroflow_heartbeats_received_total"),
        "no_key": sample_value("heteroflow_heartbeats_rejected_total", reason="not_authenticated"),
        "bad_json": sample_value("heteroflow_heartbeats_rejected_total", reason="parse_error"),
        "method": sample_value("heteroflow_heartbeats_rejected_total", reason="method_not_allowed"),
    }
    assert agents.send("hb-1", {}, headers={}).status_code == 401
    assert agents.send("hb-1", content=b"{not json").status_code == 400
    assert agents.send("hb-1", method="GET").status_code == 405
    fams = families(scrape(client))
    assert value(fams, "heteroflow_heartbeats_received_total") == before["received"] + 3
    assert value(fams, "heteroflow_heartbeats_rejected_total", reason="not_authenticated") == before["no_key"] + 1
    assert value(fams, "heteroflow_heartbeats_rejected_total", reason="parse_error") == before["bad_json"] + 1
    assert value(fams, "heteroflow_heartbeats_rejected_total", reason="method_not_allowed") == before["method"] + 1
    assert (
        value(fams, "heteroflow_heartbeats_rejected_total", reason="unavailable") is not None
    )  # every reason shows, at 0


def test_scheduling_is_counted_once_the_bind_commits(world, django_capture_on_commit_callbacks):
    make_node("n1", 2)
    task = make_task(world.tenants["acme"], gpu_required=1)
    Task.objects.filter(pk=task.pk).update(created_at=utcnow() - timedelta(seconds=90))
    before = {
        "scheduled": sample_value("heteroflow_tasks_scheduled_total"),
        "latency_le_60": sample_value("heteroflow_schedule_latency_seconds_bucket", le="60.0"),
        "latency_le_120": sample_value("heteroflow_schedule_latency_seconds_bucket", le="120.0"),
        "cycles": sample_value("heteroflow_scheduler_cycle_duration_seconds_count"),
        "binds": sample_value("heteroflow_scheduler_binds_per_cycle_sum"),
        "ran": sample_value("heteroflow_periodic_job_runs_total", job="scheduler.tick", outcome="ran"),
    }
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        assert tick_job.run(immediate=True) == "ran"
    # nothing counts until the bind's transaction commits
    assert sample_value("heteroflow_tasks_scheduled_total") == before["scheduled"]
    for callback in callbacks:
        callback()
    assert sample_value("heteroflow_tasks_scheduled_total") == before["scheduled"] + 1
    assert sample_value("heteroflow_schedule_latency_seconds_bucket", le="60.0") == before["latency_le_60"]
    assert sample_value("heteroflow_schedule_latency_seconds_bucket", le="120.0") == before["latency_le_120"] + 1
    assert sample_value("heteroflow_scheduler_cycle_duration_seconds_count") == before["cycles"] + 1
    assert sample_value("heteroflow_scheduler_binds_per_cycle_sum") == before["binds"] + 1
    assert sample_value("heteroflow_periodic_job_runs_total", job="scheduler.tick", outcome="ran") == before["ran"] + 1


# --- who may scrape ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "peer,allowed",
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("10.1.2.3", True),
        ("172.16.0.1", True),
        ("172.31.255.254", True),
        ("192.168.1.1", True),
        ("100.64.0.1", True),
        ("100.127.255.254", True),
        ("::ffff:10.0.0.1", True),
        ("172.32.0.1", False),
        ("100.128.0.1", False),
        ("8.8.8.8", False),
        ("203.0.113.7", False),
        ("2001:db8::1", False),
        ("fe80::1", False),
        ("", False),
        (None, False),
        ("not-an-ip", False),
    ],
)
def test_the_allow_list(settings, peer, allowed):
    settings.HETEROFLOW_METRICS_ALLOW_PUBLIC = False
    assert access.peer_may_scrape(peer) is allowed


def test_a_public_peer_is_refused_whatever_it_forwards(client, settings):
    settings.HETEROFLOW_METRICS_ALLOW_PUBLIC = False
    response = client.get(
        "/metrics",
        REMOTE_ADDR="203.0.113.7",
        HTTP_X_FORWARDED_FOR="127.0.0.1",
        HTTP_X_REAL_IP="10.0.0.1",
        HTTP_FORWARDED="for=127.0.0.1",
    )
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "forbidden"
    assert client.get("/metrics", REMOTE_ADDR="10.9.8.7", HTTP_X_FORWARDED_FOR="203.0.113.7").status_code == 200


def test_allow_public_opens_it(client, settings):
    settings.HETEROFLOW_METRICS_ALLOW_PUBLIC = True
    assert client.get("/metrics", REMOTE_ADDR="203.0.113.7").status_code == 200


def asgi_get(path, peer, headers=None):
    from heteroflow.asgi import application

    async def go():
        transport = httpx.ASGITransport(app=application, client=(peer, 51000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            return await http.get(path, headers=headers or {})

    return asyncio.run(go())


def test_under_asgi_the_peer_is_the_tcp_client_address(settings):
    settings.HETEROFLOW_METRICS_ALLOW_PUBLIC = False
    forged = {"X-Forwarded-For": "127.0.0.1", "X-Real-IP": "127.0.0.1"}
    assert asgi_get("/metrics", "198.51.100.4", forged).status_code == 403
    assert asgi_get("/metrics", "192.168.10.20").status_code == 200


def test_metrics_are_answered_before_the_host_check_and_https_redirect(client, settings):
    settings.ALLOWED_HOSTS = ["hf.example.com"]
    settings.SECURE_SSL_REDIRECT = True
    assert client.get("/metrics", HTTP_HOST="10.0.0.7:3333").status_code == 200


# --- the shipped rules and dashboard ---------------------------------------------------------------


def test_the_alerting_rules_parse_and_name_only_exposed_metrics(client):
    document = yaml.safe_load(RULES.read_text())
    rules = [rule for group in document["groups"] for rule in group["rules"]]
    assert len(rules) >= 10
    exposed = exposed_names(scrape(client))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert re.fullmatch(r"HeteroFlow[A-Za-z]+", rule["alert"])
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"])
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
        names = promql_metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names - PROMETHEUS_OWN <= exposed, (rule["alert"], sorted(names - PROMETHEUS_OWN - exposed))


def test_the_dashboard_parses_and_names_only_exposed_metrics(client):
    dashboard = json.loads(DASHBOARD.read_text())
    exposed = exposed_names(scrape(client))
    targets = [target for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(targets) >= 20
    named = set()
    for target in targets:
        names = promql_metric_names(target["expr"])
        assert names, target
        named |= names
    assert named <= exposed, sorted(named - exposed)
    # the dashboard covers the heteroflow metrics an operator looks at first
    assert {
        "heteroflow_schedule_latency_seconds_bucket",
        "heteroflow_nodes",
        "heteroflow_gpus",
        "heteroflow_alerts_active",
        "heteroflow_heartbeats_rejected_total",
        "heteroflow_scheduler_cycle_duration_seconds_bucket",
    } <= named


def test_the_promql_name_extraction():
    expr = 'sum by (le) (rate(foo_bucket{a="b", c=~"x|y"}[5m])) > 0.5 * sum(bar_total) and on() baz{status!="x"} > 1e9'
    assert promql_metric_names(expr) == {"foo_bucket", "bar_total", "baz"}
