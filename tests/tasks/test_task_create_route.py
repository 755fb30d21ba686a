"""POST /api/v1/tasks through the thin ASGI route (apps.tasks.api.create_route) answers
exactly as the DRF view does: the same status, body and headers for good bodies, each
kind of bad body, bad keys, the wrong role and an exceeded quota; what it does not
handle itself goes to Django unchanged. The route runs creates on its own threads and
connections, hence committed data (transactional tests)."""

import asyncio

import httpx
import pytest
from django.core.asgi import get_asgi_application
from rest_framework.test import APIClient

from apps.alerts.choices import AlertState, AlertType
from apps.alerts.models import Alert
from apps.confidential.services import put_secret
from apps.core.principals import Principal, PrincipalKind
from apps.tasks.api.create_route import TaskCreateApp
from apps.tasks.models import Task
from apps.tenants import services
from apps.tenants.choices import Role
from apps.tenants.models import ApiKey
from tests.factories import OperatorFactory, UserFactory
from tests.headers import AGENT, AGENT_HTTP, bearer, bearer_http

pytestmark = pytest.mark.django_db(transaction=True)

JOB = {"name": "sweep", "image": "registry.local/sweep:1", "command": ["python", "run.py"], "gpu_required": 1}
# headers both paths put on an answer (Django's middleware and DRF's, or the route's)
COMPARED_HEADERS = (
    "content-type",
    "allow",
    "www-authenticate",
    "x-frame-options",
    "x-content-type-options",
    "referrer-policy",
    "cross-origin-opener-policy",
)
VOLATILE = ("id", "created_at", "updated_at")
SERVING = {
    "engine": "llama.cpp",
    "model": "tiny",
    "format": "gguf",
    "source": "/models/tiny.gguf",
    "args": ["-c", "512"],
}


class Route:
    """The route in front of the real Django ASGI application, counting what it hands on."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.handed_on = 0
        django_app = get_asgi_application()

        async def fallback(scope, receive, send):
            self.handed_on += 1
            await django_app(scope, receive, send)

        self.app = TaskCreateApp(fallback)

    def post(self, *, json=None, content=None, headers):
        async def go():
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                if content is not None:
                    sent = {"Content-Type": "application/json"} | headers
                    return await client.post("/api/v1/tasks", content=content, headers=sent)
                return await client.post("/api/v1/tasks", json=json, headers=headers)

        return self.loop.run_until_complete(go())

    def post_together(self, bodies, headers):
        async def go():
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                return await asyncio.gather(*(client.post("/api/v1/tasks", json=b, headers=headers) for b in bodies))

        return self.loop.run_until_complete(go())

    def close(self):
        self.app.shutdown()  # each create thread holds a connection to the test database
        self.loop.close()


@pytest.fixture
def route():
    route = Route()
    yield route
    route.close()


@pytest.fixture
def people():
    """One tenant with an admin, a member and a viewer (keys for each), an operator, and
    a secret; committed, and taken away afterwards."""
    operator = OperatorFactory(username="route-op")
    tenant = services.create_tenant(name="Route", slug="route")
    keys = {"operator": services.issue_platform_key(user=operator, name="ops").key}
    for role in (Role.ADMIN, Role.MEMBER, Role.VIEWER):
        user = UserFactory(username=f"route-{role}")
        services.add_member(tenant, username=user.username, role=role)
        owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=role)
        keys[role] = services.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name=role).key
    revoked = services.issue_tenant_key(
        principal=Principal(PrincipalKind.OPERATOR, user=operator), tenant=tenant, owner=user, name="gone"
    )
    services.revoke_key(revoked.api_key, principal=Principal(PrincipalKind.OPERATOR, user=operator))
    keys["revoked"] = revoked.key
    put_secret(tenant, "hf-token", "s3cret")
    yield tenant, keys
    Task.objects.filter(tenant=tenant).delete()
    services.delete_tenant(tenant)


def comparable(response):
    try:
        body = response.json()
    except ValueError:
        body = response.content
    if isinstance(body, dict):
        body = {key: value for key, value in body.items() if key not in VOLATILE}
    headers = {name: response.headers.get(name) for name in COMPARED_HEADERS}
    return response.status_code, body, headers


def through_django(headers, *, json=None, content=None):
    client = APIClient()
    if content is not None:
        return client.generic("POST", "/api/v1/tasks", content, content_type="application/json", **headers)
    return client.post("/api/v1/tasks", json, format="json", **headers)


CASES = [
    # (name, who, body changes, expected status)
    ("operator names the tenant", "operator", {"tenant": "route"}, 201),
    (
        "a member, everything set",
        "member",
        {
            "env": {"LR": "0.1", "TOKEN": {"secret": "hf-token"}},
            "labels": {"a": "b"},
            "volumes": [{"host": "/data", "container": "/data"}],
            "priority": 70,
            "gpu_memory_mb": 16000,
        },
        201,
    ),
    ("an admin", "admin", {}, 201),
    ("a viewer", "viewer", {}, 403),
    ("operator without a tenant", "operator", {}, 400),
    ("a tenant that is not there", "operator", {"tenant": "nowhere"}, 404),
    ("another tenant's slug", "member", {"tenant": "nowhere"}, 404),
    ("unknown fields", "member", {"colour": "red", "size": 2}, 400),
    ("a cross-field rule", "member", {"kind": "training", "preemptible": True}, 400),
    ("out of range", "member", {"priority": 101, "gpu_required": -1}, 400),
    ("a wrong type", "member", {"gpu_required": "two", "command": "python run.py"}, 400),
    ("a bad variable name", "member", {"env": {"1BAD": "x"}}, 400),
    ("a missing secret", "member", {"env": {"TOKEN": {"secret": "nope"}}}, 400),
    ("an unknown nested field", "member", {"volumes": [{"host": "/a", "container": "/b", "mode": "rw"}]}, 400),
    ("a probe on a job", "member", {"health_probe": {"type": "http", "port": 8000}}, 400),
    ("a missing required field", "member", {"name": None}, 400),
    ("an inference task's serving", "member", {"kind": "inference", "serving": SERVING}, 201),
    (
        "serving with its defaults",
        "member",
        {"kind": "inference", "serving": {"model": "m", "format": "gguf", "source": "/m"}},
        201,
    ),
    ("serving on a job", "member", {"serving": SERVING}, 400),
    ("serving of an unknown format", "member", {"kind": "inference", "serving": SERVING | {"format": "pickle"}}, 400),
    ("serving with an unknown key", "member", {"kind": "inference", "serving": SERVING | {"port": 1}}, 400),
    ("serving args not strings", "member", {"kind": "inference", "serving": SERVING | {"args": [1, [2]]}}, 400),
    ("an unknown key", "bad-key", {}, 401),
    ("a revoked key", "revoked", {}, 401),
]


def headers_for(who, keys, *, http):
    key = "sk-tenant-not-a-real-key" if who == "bad-key" else keys[who]
    return bearer_http(key) if http else bearer(key)


@pytest.mark.parametrize("name,who,changes,expected", CASES, ids=[case[0] for case in CASES])
def test_the_route_answers_as_the_django_view(route, people, name, who, changes, expected):
    tenant, keys = people
    body = {key: value for key, value in (JOB | changes).items() if value is not None}
    before = Task.objects.count()
    fast = route.post(json=body, headers=headers_for(who, keys, http=True))
    slow = through_django(headers_for(who, keys, http=False), json=body)
    assert fast.status_code == expected, fast.text
    assert comparable(fast) == comparable(slow)
    assert route.handed_on == 0  # answered by the route itself
    assert Task.objects.count() == before + (2 if expected == 201 else 0)
    if expected == 201:
        task = Task.objects.get(pk=fast.json()["id"])
        assert (task.tenant_id, task.status, task.created_by.username) == (
            tenant.pk,
            "pending",
            fast.json()["created_by"],
        )
        asked = {"engine": "auto", "args": []} | body["serving"] if "serving" in body else {}
        assert task.serving == fast.json()["serving"] == asked


def test_an_exceeded_quota_is_the_same_409_and_the_same_alert(route, people):
    tenant, keys = people
    services.update_tenant(tenant, max_concurrent_tasks=1)
    assert route.post(json=JOB, headers=bearer_http(keys["member"])).status_code == 201
    fast = route.post(json=JOB, headers=bearer_http(keys["member"]))
    slow = through_django(bearer(keys["member"]), json=JOB)
    assert fast.status_code == 409 and fast.json()["error"]["code"] == "quota_exceeded"
    assert comparable(fast) == comparable(slow)
    assert Task.objects.filter(tenant=tenant).count() == 1
    assert (
        Alert.objects.filter(type=AlertType.QUOTA_EXCEEDED, tenant_id=tenant.pk, state=AlertState.ACTIVE).count() == 1
    )


def test_concurrent_creates_through_the_route_never_pass_the_quota(route, people):
    tenant, keys = people
    services.update_tenant(tenant, max_concurrent_tasks=3)
    answers = route.post_together([JOB | {"name": f"t{i}"} for i in range(8)], bearer_http(keys["member"]))
    assert sorted(answer.status_code for answer in answers) == [201] * 3 + [409] * 5
    assert Task.objects.filter(tenant=tenant).count() == 3


HANDED_ON = [
    ("not JSON", {"content": b'{"name": '}, "member"),
    ("JSON but not an object", {"content": b'["a"]'}, "member"),
    ("JSON null", {"content": b"null"}, "member"),
    ("no credentials", {"json": JOB}, None),
    ("the agent key", {"json": JOB}, "agent"),
]


@pytest.mark.parametrize("name,body,who", HANDED_ON, ids=[case[0] for case in HANDED_ON])
def test_what_the_route_does_not_handle_goes_to_django_unchanged(route, people, name, body, who):
    _, keys = people
    http = {} if who is None else AGENT_HTTP if who == "agent" else bearer_http(keys[who])
    environ = {} if who is None else AGENT if who == "agent" else bearer(keys[who])
    fast = route.post(headers=http, **body)
    slow = through_django(environ, **body)
    assert fast.status_code in (400, 401, 403), fast.text
    assert comparable(fast) == comparable(slow)
    assert route.handed_on == 1
    assert Task.objects.count() == 0


def test_another_content_type_or_host_goes_to_django(route, people, settings):
    _, keys = people
    settings.ALLOWED_HOSTS = ["testserver"]
    answer = route.post(content=b"name=x", headers=bearer_http(keys["member"]) | {"Content-Type": "text/plain"})
    assert answer.status_code == 415 and route.handed_on == 1
    answer = route.post(json=JOB, headers=bearer_http(keys["member"]) | {"Host": "evil.example"})
    assert answer.status_code == 400 and route.handed_on == 2
    assert Task.objects.count() == 0


def test_a_key_whose_owner_left_the_tenant_is_refused_alike(route, people):
    tenant, keys = people
    membership = tenant.memberships.get(user__username="route-viewer")
    membership.delete()
    fast = route.post(json=JOB, headers=bearer_http(keys["viewer"]))
    slow = through_django(bearer(keys["viewer"]), json=JOB)
    assert fast.status_code == 401 and comparable(fast) == comparable(slow)
    assert ApiKey.objects.filter(name="viewer").exists()


@pytest.mark.parametrize("pool,threads", [(None, 4), ({"max_size": 10}, 4), ({"max_size": 4}, 2), ({"max_size": 1}, 1)])
def test_the_route_keeps_at_most_half_the_pool(pool, threads):
    from unittest import mock

    from django.conf import settings

    from apps.tasks.api.create_route import create_threads

    options = {key: value for key, value in settings.DATABASES["default"].get("OPTIONS", {}).items() if key != "pool"}
    with mock.patch.dict(settings.DATABASES["default"], {"OPTIONS": options | ({"pool": pool} if pool else {})}):
        assert create_threads() == threads
