import socket
import threading
import time
from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.core.models import JobRun
from apps.monitoring import probes
from tests.live import free_port

pytestmark = pytest.mark.django_db


def test_health_answers_200_degraded_while_no_scheduler_runs(client):
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "degraded"}
    detail = client.get("/health/detail").json()
    assert detail == {"status": "degraded", "database": "ok", "scheduler": "not_running"}


def test_health_is_ok_when_the_scheduler_ticked_recently(client):
    JobRun.objects.create(key=probes.SCHEDULER_JOB_KEY, last_started_at=utcnow(), last_finished_at=utcnow())
    assert client.get("/health/detail").json() == {"status": "ok", "database": "ok", "scheduler": "running"}
    JobRun.objects.filter(key=probes.SCHEDULER_JOB_KEY).update(last_finished_at=utcnow() - timedelta(minutes=1))
    assert client.get("/health/detail").json()["scheduler"] == "not_running"


def unreachable(monkeypatch, host, port):
    real = probes.database_params

    def pointing_elsewhere(**overrides):
        return real(**overrides) | {"host": host, "port": str(port)}

    monkeypatch.setattr(probes, "database_params", pointing_elsewhere)


def test_health_is_503_when_the_database_refuses_connections(client, monkeypatch):
    unreachable(monkeypatch, "127.0.0.1", free_port())
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json() == {"status": "unhealthy"}
    detail = client.get("/health/detail")
    assert detail.status_code == 503
    assert detail.json() == {"status": "unhealthy", "database": "unreachable", "scheduler": "unknown"}


@pytest.fixture
def silent_server():
    """Accepts TCP connections and never says a word, like a hung database host."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    for conn in accepted:
        conn.close()
    server.close()


def test_health_gives_up_on_a_database_that_does_not_answer(client, monkeypatch, silent_server):
    unreachable(monkeypatch, "127.0.0.1", silent_server)
    started = time.monotonic()
    response = client.get("/health")
    elapsed = time.monotonic() - started
    assert response.status_code == 503
    # the probe's limit is 2 s; anything near a minute would mean it hung on the socket
    assert elapsed < 10, elapsed


@pytest.mark.parametrize("path", ["/health", "/health/detail"])
def test_probes_by_ip_over_plain_http_are_answered_in_production(client, settings, path):
    settings.ALLOWED_HOSTS = ["hf.example.com"]
    settings.SECURE_SSL_REDIRECT = True
    assert client.get(path, HTTP_HOST="10.0.0.7:3333").status_code == 200
    # everything else still gets the host check and the redirect
    assert client.get("/api/v1/tenants", HTTP_HOST="10.0.0.7:3333").status_code == 400
    assert client.get("/api/v1/tenants", HTTP_HOST="hf.example.com").status_code == 301


def test_probes_accept_only_get(client):
    assert client.post("/health").status_code == 405
