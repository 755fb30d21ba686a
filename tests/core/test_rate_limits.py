"""The API's rate limits (apps.core.throttling, docs/security.md#rate-limits): a key over
its rate gets 429 with Retry-After, through DRF and through the thin task-create route;
the window resets; agents working at their normal rate are never limited, however many
nodes share the agent key. Time is moved with time-machine, never slept through; the
counters are the real ones in Redis."""

from __future__ import annotations

import asyncio
import secrets

import httpx
import pytest
import time_machine
from django.core.asgi import get_asgi_application
from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured
from rest_framework.test import APIClient

from apps.core import throttling
from apps.core.principals import AGENT, Principal, PrincipalKind
from apps.tasks.api.create_route import TaskCreateApp
from apps.tasks.models import Task
from apps.tenants import services
from apps.tenants.choices import Role
from heteroflow.rates import Rate, parse_rate
from tests.factories import OperatorFactory, UserFactory
from tests.headers import AGENT as AGENT_HEADERS
from tests.headers import bearer, bearer_http
from tests.nodes.agents import Agents
from tests.nodes.payloads import heartbeat as heartbeat_payload

# a window boundary for every period the tests use (60 s, 900 s)
T0 = 1_800_000_000.0


@pytest.fixture
def clock():
    """Time stands still at T0 (the start of a window) until the test moves it. Each
    test counts in windows of its own: the counters of an earlier run of the suite
    are still in Redis until they expire."""
    start = T0 + 900 * secrets.randbelow(100_000)
    with time_machine.travel(start, tick=False) as traveller:
        traveller.start = start
        yield traveller


@pytest.mark.parametrize(
    "text,rate",
    [
        ("6000/min", Rate(6000, 60)),
        ("100/s", Rate(100, 1)),
        ("50/10s", Rate(50, 10)),
        ("20000/h", Rate(20000, 3600)),
        (" 3 / minute ", Rate(3, 60)),
        ("off", Rate(0, 1)),
        ("0", Rate(0, 1)),
    ],
)
def test_rates_are_read_as_settings_spell_them(text, rate):
    assert parse_rate("X", text) == rate


@pytest.mark.parametrize("text", ["", "fast", "10", "10/fortnight", "0/min", "10/0s", "-1/s", "1.5/s"])
def test_a_bad_rate_stops_the_process_naming_the_setting(text):
    with pytest.raises(ImproperlyConfigured, match="HETEROFLOW_API_RATE="):
        parse_rate("HETEROFLOW_API_RATE", text)


def test_the_defaults_are_sane():
    from django.conf import settings

    assert settings.HETEROFLOW_API_RATE == Rate(6000, 60)
    assert settings.HETEROFLOW_API_RATE_AGENT_NODE == Rate(3000, 60)
    assert "apps.core.throttling.PrincipalRateThrottle" in settings.REST_FRAMEWORK["DEFAULT_THROTTLE_CLASSES"]


@pytest.fixture
def keys(db):
    operator = OperatorFactory(username="rl-op")
    tenant = services.create_tenant(name="Rl", slug="rl")
    user = UserFactory(username="rl-member")
    services.add_member(tenant, username=user.username, role=Role.MEMBER)
    owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=Role.MEMBER)
    return {
        "operator": services.issue_platform_key(user=operator, name="ops").key,
        "member": services.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name="a").key,
        "member-2": services.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name="b").key,
        "user": user,
    }


def get(key, path="/api/v1/nodes"):
    return APIClient().get(path, **bearer(key))


def test_a_key_over_its_rate_gets_429_with_retry_after_until_the_window_ends(keys, settings, clock):
    settings.HETEROFLOW_API_RATE = Rate(3, 60)
    assert [get(keys["member"]).status_code for _ in range(3)] == [200, 200, 200]
    clock.shift(10)
    refused = get(keys["member"])
    assert refused.status_code == 429
    assert refused["Retry-After"] == "50"
    assert refused.json()["error"]["code"] == "throttled"
    clock.shift(49)
    assert get(keys["member"]).status_code == 429
    assert get(keys["member"])["Retry-After"] == "1"
    clock.shift(1)  # the next window
    assert get(keys["member"]).status_code == 200


def test_the_limit_is_per_key(keys, settings, clock):
    settings.HETEROFLOW_API_RATE = Rate(2, 60)
    assert [get(keys["member"]).status_code for _ in range(3)] == [200, 200, 429]
    # the same person's other key, and another principal, count on their own
    assert get(keys["member-2"]).status_code == 200
    assert get(keys["operator"]).status_code == 200


def test_a_signed_in_person_is_counted_per_user(keys, settings, clock):
    settings.HETEROFLOW_API_RATE = Rate(2, 60)
    client = APIClient()
    client.force_login(keys["user"])
    assert [client.get("/api/v1/nodes").status_code for _ in range(3)] == [200, 200, 429]


def test_a_request_without_valid_credentials_is_refused_before_counting(keys, settings, clock):
    settings.HETEROFLOW_API_RATE = Rate(1, 60)
    assert [get("sk-tenant-not-a-real-key").status_code for _ in range(3)] == [401, 401, 401]
    assert APIClient().get("/api/v1/nodes").status_code == 401


def test_the_limit_can_be_turned_off(keys, settings, clock):
    settings.HETEROFLOW_API_RATE = parse_rate("HETEROFLOW_API_RATE", "off")
    assert {get(keys["member"]).status_code for _ in range(20)} == {200}


def test_an_unreachable_cache_lets_requests_through(keys, settings, clock, monkeypatch):
    settings.HETEROFLOW_API_RATE = Rate(1, 60)

    def down(*args, **kwargs):
        raise ConnectionError("redis is restarting")

    monkeypatch.setattr(cache, "incr", down)
    assert [get(keys["member"]).status_code for _ in range(3)] == [200, 200, 200]


def poll(node_id):
    return APIClient().get("/api/v1/tasks", {"node_id": node_id, "status": "scheduled", "limit": 10}, **AGENT_HEADERS)


@pytest.mark.django_db
def test_agents_at_their_normal_rate_are_never_limited_however_many_share_the_key(settings, clock):
    """Every node polls every 5 s: 12 polls a minute each. With the per-node rate set to
    exactly that and the per-key rate far below the fleet's total, two minutes of a
    20-node fleet (480 polls with the one agent key, 48 times the key's rate) are all
    answered."""
    settings.HETEROFLOW_API_RATE = Rate(5, 60)
    settings.HETEROFLOW_API_RATE_AGENT_NODE = Rate(12, 60)
    nodes = [f"rl-node-{i:03d}" for i in range(20)]
    statuses = set()
    for _ in range(24):
        statuses |= {poll(node).status_code for node in nodes}
        clock.shift(5)
    assert statuses == {200}


@pytest.mark.django_db
def test_one_node_polling_too_fast_is_limited_alone(settings, clock):
    settings.HETEROFLOW_API_RATE_AGENT_NODE = Rate(12, 60)
    assert [poll("rl-fast").status_code for _ in range(13)] == [200] * 12 + [429]
    assert poll("rl-fast")["Retry-After"] == "60"
    assert poll("rl-steady").status_code == 200
    clock.shift(60)
    assert poll("rl-fast").status_code == 200


def test_agent_requests_that_name_no_node_are_not_counted():
    assert throttling.principal_bucket(AGENT, None) is None
    assert throttling.principal_bucket(AGENT, "n1")[0:2] == ("agent-node", "n1")
    assert throttling.principal_bucket(None) is None


@pytest.mark.django_db(transaction=True)
def test_heartbeats_are_never_counted(settings, clock):
    """The heartbeat is a thin ASGI route outside DRF: even with every rate at one a
    minute, a node's beats keep being taken."""
    settings.HETEROFLOW_API_RATE = Rate(1, 60)
    settings.HETEROFLOW_API_RATE_AGENT_NODE = Rate(1, 60)
    agents = Agents()
    try:
        statuses = []
        for _ in range(5):
            statuses.append(agents.send("rl-beating", heartbeat_payload()).status_code)
            clock.shift(5)
        assert statuses == [200] * 5
    finally:
        agents.close()


class CreateRoute:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.app = TaskCreateApp(get_asgi_application())

    def post(self, key, body):
        async def go():
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                return await client.post("/api/v1/tasks", json=body, headers=bearer_http(key))

        return self.loop.run_until_complete(go())

    def close(self):
        self.app.shutdown()
        self.loop.close()


@pytest.mark.django_db(transaction=True)
def test_the_thin_task_create_route_is_limited_as_drf_is(settings, clock):
    settings.HETEROFLOW_API_RATE = Rate(2, 60)
    tenant = services.create_tenant(name="Rl route", slug="rl-route")
    user = UserFactory(username="rl-route-member")
    services.add_member(tenant, username=user.username, role=Role.MEMBER)
    owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=Role.MEMBER)
    key = services.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name="k").key
    route = CreateRoute()
    try:
        body = {"name": "sweep", "image": "registry.local/sweep:1", "command": ["true"], "gpu_required": 1}
        first = [route.post(key, body) for _ in range(2)]
        assert [r.status_code for r in first] == [201, 201]
        clock.shift(15)
        refused = route.post(key, body)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "45"
        assert refused.json()["error"]["code"] == "throttled"
        assert Task.objects.filter(tenant=tenant).count() == 2  # nothing written when refused
        # DRF answers the same for the same key in the same window
        through_django = APIClient().post("/api/v1/tasks", body, format="json", **bearer(key))
        assert (through_django.status_code, through_django["Retry-After"]) == (429, "45")
        assert through_django.json() == refused.json()
        clock.shift(45)
        assert route.post(key, body).status_code == 201
    finally:
        route.close()
        Task.objects.filter(tenant=tenant).delete()
        services.delete_tenant(tenant)
