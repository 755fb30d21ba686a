"""Real processes on real ports: the web server with two uvicorn workers in
multiprocess mode and its separate metrics listener, a listener's readiness and peer
judgement, a Celery worker whose pool processes count what its exporter shows (and
which samples its own host at start), and beat's exporter."""

import ipaddress
import signal
import subprocess
import sys
import uuid

import pytest
import redis
import requests
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from prometheus_client.parser import text_string_to_metric_families

from apps.monitoring import access, exposition, listener, probes
from apps.monitoring.models import ServerMetric
from heteroflow.envvars import Env
from tests.headers import AGENT_HTTP
from tests.live import REPO, free_port, server_env, start_control_plane, stop_process, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def metric(text, name, **labels):
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def scrape(url):
    response = requests.get(url, timeout=10)
    assert response.status_code == 200, response.text
    return response.text


def test_two_web_workers_report_one_set_of_counters_on_both_ports(tmp_path):
    folder = tmp_path / "web-metrics"
    folder.mkdir()
    listen = free_port()
    server, url = start_control_plane(
        env={"PROMETHEUS_MULTIPROC_DIR": str(folder), "METRICS_LISTEN_ADDR": f"127.0.0.1:{listen}"},
        args=("--workers", "2"),
    )
    try:
        from tests.nodes.payloads import heartbeat

        agent = AGENT_HTTP
        applied = requests.post(f"{url}/api/v1/nodes/live-mp-1/heartbeat", json=heartbeat(2), headers=agent, timeout=10)
        assert applied.status_code == 200, applied.text
        for _ in range(6):
            assert requests.post(f"{url}/api/v1/nodes/live-mp-1/heartbeat", json={}, timeout=10).status_code == 401
        # both workers write their own files into the one folder...
        pids = {path.stem.rsplit("_", 1)[1] for path in folder.glob("counter_*.db")}
        assert len(pids) >= 2, pids
        # ...and whichever answers, the sums are the same
        for _ in range(6):
            text = scrape(f"{url}/metrics")
            assert metric(text, "heteroflow_heartbeats_received_total") == 7
            assert metric(text, "heteroflow_heartbeats_rejected_total", reason="not_authenticated") == 6
        separate = scrape(f"http://127.0.0.1:{listen}/metrics")
        assert metric(separate, "heteroflow_heartbeats_received_total") == 7
        assert (
            metric(separate, "heteroflow_nodes", status="online", gpu_type="nvidia") == 1
        )  # the snapshot is there too
        assert metric(separate, "process_resident_memory_bytes") > 0
        health = requests.get(f"http://127.0.0.1:{listen}/healthz", timeout=10)
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        ready = requests.get(f"http://127.0.0.1:{listen}/readyz", timeout=10)
        assert (ready.status_code, ready.json()["status"]) == (200, "ready")
        assert requests.get(f"http://127.0.0.1:{listen}/api/v1/tenants", timeout=10).status_code == 404
    finally:
        stop_process(server)


@pytest.fixture
def own_listener():
    started = []

    def start(**kwargs):
        running = listener.MetricsListener("127.0.0.1", 0, source=exposition.WEB, **kwargs).start()
        started.append(running)
        return f"http://127.0.0.1:{running.address[1]}"

    yield start
    for running in started:
        running.stop()


def test_readiness_says_why_when_the_database_does_not_answer(own_listener, monkeypatch):
    base = own_listener(readiness=listener.database_readiness)
    assert requests.get(f"{base}/readyz", timeout=10).status_code == 200
    real = probes.database_params
    monkeypatch.setattr(
        probes, "database_params", lambda **o: real(**o) | {"host": "127.0.0.1", "port": str(free_port())}
    )
    response = requests.get(f"{base}/readyz", timeout=10)
    assert response.status_code == 503
    assert response.json() == {"status": "unready", "reason": "database unreachable"}
    assert requests.get(f"{base}/healthz", timeout=10).status_code == 200  # alive all the same


def test_the_listener_judges_the_tcp_peer_not_forwarded_headers(own_listener, monkeypatch, settings):
    settings.HETEROFLOW_METRICS_ALLOW_PUBLIC = False
    base = own_listener()
    assert requests.get(f"{base}/metrics", timeout=10).status_code == 200  # loopback
    # as if loopback were not allowed: the peer (127.0.0.1) decides, whatever it forwards
    monkeypatch.setattr(access, "SCRAPE_NETWORKS", (ipaddress.ip_network("10.0.0.0/8"),))
    refused = requests.get(
        f"{base}/metrics", headers={"X-Forwarded-For": "10.1.2.3", "X-Real-IP": "10.1.2.3"}, timeout=10
    )
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    settings.HETEROFLOW_METRICS_ALLOW_PUBLIC = True
    assert requests.get(f"{base}/metrics", timeout=10).status_code == 200


def test_a_second_listener_on_a_taken_port_steps_aside(own_listener):
    base = own_listener()
    port = int(base.rsplit(":", 1)[1])
    assert listener.start(("127.0.0.1", port), source=exposition.WEB, name="second") is None
    assert requests.get(f"{base}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("127.0.0.1:9090", ("127.0.0.1", 9090)),
        (":9101", ("0.0.0.0", 9101)),
        ("[::1]:9090", ("::1", 9090)),
        ("metrics.internal:80", ("metrics.internal", 80)),
        (" ", None),
    ],
)
def test_listen_addresses(raw, expected):
    assert Env({"X": raw}).address("X") == expected


@pytest.mark.parametrize("raw", ["9090", "host:", "host:0", "host:65536", "host:http", "a b:80"])
def test_bad_listen_addresses_stop_start_up(raw):
    with pytest.raises(ImproperlyConfigured, match="X="):
        Env({"X": raw}).address("X")


def celery(args, **env):
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_worker", *args, "--loglevel", "WARNING"],
        cwd=REPO,
        env=server_env(**env),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture
def broker_keys():
    """Names whose Redis keys (queues, bindings) are removed after the test."""
    names = []
    yield names
    client = redis.Redis.from_url(settings.REDIS_URL)
    for name in names:
        for key in client.scan_iter(f"*{name}*"):
            client.delete(key)
    client.close()


def test_a_worker_samples_its_host_and_exports_what_its_pool_counts(tmp_path, broker_keys):
    host = f"test-host-{uuid.uuid4().hex[:8]}"
    broker_keys.append(host)
    folder = tmp_path / "worker-metrics"
    folder.mkdir()
    port = free_port()
    worker = celery(
        # its own queue only (and its host's): nothing else in the test broker reaches it
        [
            "worker",
            "-Q",
            f"test-{host}",
            "--concurrency",
            "2",
            "--pool",
            "prefork",
            "-n",
            f"{host}@%h",
            "--without-mingle",
            "--without-gossip",
        ],
        PROMETHEUS_MULTIPROC_DIR=str(folder),
        HETEROFLOW_WORKER_METRICS_ADDR=f"127.0.0.1:{port}",
        HETEROFLOW_SERVER_METRICS_HOST=host,
    )
    broker_keys.append(f"test-{host}")
    try:
        # the worker sends the per-host job to its host's queue at start
        row = wait_until(lambda: ServerMetric.objects.filter(host=host).first(), 90, "the worker's first host sample")
        assert row.memory_total_bytes > 0 and row.cpu_percent is not None and row.net_recv_bytes_per_second is None

        def exported():
            try:
                text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except requests.RequestException:
                return None
            done = metric(
                text, "heteroflow_celery_task_runs_total", task="monitoring.collect_server_metrics", outcome="success"
            )
            return text if done else None

        text = wait_until(exported, 60, "the worker's exporter to show the job")
        # counted in a pool process, shown by the main process's exporter
        assert (
            metric(text, "heteroflow_periodic_job_runs_total", job="monitoring.collect_server_metrics", outcome="ran")
            >= 1
        )
        assert (
            metric(text, "heteroflow_celery_task_duration_seconds_count", task="monitoring.collect_server_metrics") >= 1
        )
        assert metric(text, "process_start_time_seconds") > 0
        assert metric(text, "heteroflow_nodes") is None  # the snapshot is the web's alone
        assert len({path.name for path in folder.glob("*.db")}) >= 2
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        stop_process(worker, sig=signal.SIGTERM, timeout=60)


def test_beat_exports_the_ticks_it_sends(tmp_path):
    folder = tmp_path / "beat-metrics"
    folder.mkdir()
    port = free_port()
    beat = celery(
        ["beat", "--schedule", str(tmp_path / "schedule")],
        PROMETHEUS_MULTIPROC_DIR=str(folder),
        HETEROFLOW_BEAT_METRICS_ADDR=f"127.0.0.1:{port}",
    )
    try:

        def ticks():
            try:
                text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except requests.RequestException:
                return None
            return metric(text, "heteroflow_celery_tasks_published_total", task="scheduler.tick")

        assert wait_until(ticks, 60, "beat to send a scheduler tick") >= 1
    finally:
        stop_process(beat, timeout=60)
