"""The cross-tenant matrix, generated from the URL configuration (issue 20): for every API
route that takes an object id, tenant B's admin, member and viewer (by key and by
session) try every method the route has on tenant A's object. Each answer must be what
the same principal gets for an id that does not exist (so nothing tells that A's object
is there), never a success, never a 403 that only A's object gets, never A's data; and
nothing in the database changes.

A route added later is in the matrix by itself: it needs an entry in OWNED (how to name
an object of tenant A for it) or in NOT_TENANT_OWNED (why it has none); a route that
takes an id and is in neither fails `test_every_route_with_an_id_is_in_the_matrix`."""

from __future__ import annotations

import pytest
from django.apps import apps as django_apps
from django.db import connection
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from apps.alerts.models import NotificationChannel
from apps.gateway.models import EndpointKey, ExternalBackend
from apps.inference.models import Model
from apps.nodes.models import ImageRequest
from apps.tenants.models import ApiKey, TenantGroup
from tests.factories import make_alert, make_group, make_node, make_slice, make_slice_request, make_task
from tests.headers import bearer
from tests.inference.service_rows import make_service

pytestmark = pytest.mark.django_db

BETA_PRINCIPALS = ("beta-admin", "beta-member", "beta-viewer", "beta-admin-session")
WRITE_BODY = {"name": "x", "reason": "x", "replicas": 1, "role": "viewer", "node_id": "n1"}
MISSING_INT, MISSING_STR = 987_654_321, "no-such-object-anywhere"


def api_routes():
    """(route, name, view class) of every API route whose pattern takes an argument."""

    def walk(resolver, prefix=""):
        for pattern in resolver.url_patterns:
            if isinstance(pattern, URLResolver):
                yield from walk(pattern, prefix + str(pattern.pattern))
            elif isinstance(pattern, URLPattern):
                yield prefix + str(pattern.pattern), pattern

    for route, pattern in walk(get_resolver()):
        if route.startswith("api/") and pattern.pattern.converters:
            yield route, pattern.name, getattr(pattern.callback, "cls", None) or pattern.callback


# route name → why no tenant owns what its id names (the matrix cannot be built for it)
NOT_TENANT_OWNED = {
    "agent-dist-index": "the agent's install files: public, per architecture",
    "agent-dist-file": "the agent's install files: public, per architecture",
    "scheduler-plugin": "scheduler plugins are the cluster's, operators only",
    "watched-image-detail": "the watched images are the cluster's (per GPU vendor), operators only",
    "emission-factor": "the regions' emission factors are the cluster's, operators only",
    "admin-queue": "queues are set by operators only (a tenant's people read theirs at /queue, no id)",
    "simulation": "replays are the cluster's, operators only (docs/simulate.md)",
    "simulation-chart": "replays are the cluster's, operators only (docs/simulate.md)",
}

# route name → a function of (world, objects) giving the URL kwargs of tenant A's object
OWNED = {
    "tenant-detail": lambda w, o: {"slug": "acme"},
    "member-list": lambda w, o: {"slug": "acme"},
    "member-detail": lambda w, o: {"slug": "acme", "username": "acme-member"},
    "tenant-audit": lambda w, o: {"slug": "acme"},
    "tenant-group-detail": lambda w, o: {"pk": o["tenant_group"].pk},
    "api-key-detail": lambda w, o: {"pk": o["api_key"].pk},
    "node-metrics": lambda w, o: {"node_id": o["node"].pk},
    "node-detail": lambda w, o: {"node_id": o["node"].pk},
    "node-energy": lambda w, o: {"node_id": o["node"].pk},
    "node-images-pull": lambda w, o: {"node_id": o["node"].pk},
    "node-images-check": lambda w, o: {"node_id": o["node"].pk},
    "node-images-watched": lambda w, o: {"node_id": o["node"].pk},
    "image-request-detail": lambda w, o: {"pk": o["image_request"].pk},
    "agent-image-request": lambda w, o: {"pk": o["image_request"].pk},
    "node-gpu": lambda w, o: {"node_id": o["node"].pk, "index": 0},
    "node-gpu-health": lambda w, o: {"node_id": o["node"].pk, "index": 0},
    "node-gpu-cordon": lambda w, o: {"node_id": o["node"].pk, "index": 0},
    "node-gpu-uncordon": lambda w, o: {"node_id": o["node"].pk, "index": 0},
    "node-location": lambda w, o: {"node_id": o["node"].pk},
    "node-energy-settings": lambda w, o: {"node_id": o["node"].pk},
    "node-tenant": lambda w, o: {"node_id": o["node"].pk},
    "node-drain": lambda w, o: {"node_id": o["node"].pk},
    "node-maintenance": lambda w, o: {"node_id": o["node"].pk},
    "node-return": lambda w, o: {"node_id": o["node"].pk},
    "task-detail": lambda w, o: {"pk": o["task"].pk},
    "task-logs": lambda w, o: {"pk": o["task"].pk},
    "task-metrics": lambda w, o: {"pk": o["task"].pk},
    "task-events": lambda w, o: {"pk": o["task"].pk},
    "task-app": lambda w, o: {"pk": o["task"].pk},
    "task-container-lost": lambda w, o: {"pk": o["task"].pk},
    "task-stop": lambda w, o: {"pk": o["task"].pk},
    "task-cancel": lambda w, o: {"pk": o["task"].pk},
    "task-resubmit": lambda w, o: {"pk": o["task"].pk},
    "task-group-detail": lambda w, o: {"pk": o["group"].pk},
    "task-group-stop": lambda w, o: {"pk": o["group"].pk},
    "task-group-events": lambda w, o: {"pk": o["group"].pk},
    "task-group-logs": lambda w, o: {"pk": o["group"].pk},
    "task-group-explain": lambda w, o: {"pk": o["group"].pk},
    "task-explain": lambda w, o: {"pk": o["task"].pk},
    "model-detail": lambda w, o: {"pk": o["model"].pk},
    "inference-service-detail": lambda w, o: {"id": o["service"].pk},
    "inference-service-scale": lambda w, o: {"id": o["service"].pk},
    "inference-service-stop": lambda w, o: {"id": o["service"].pk},
    "inference-service-wake": lambda w, o: {"id": o["service"].pk},
    "inference-service-decisions": lambda w, o: {"id": o["service"].pk},
    "endpoint-key-detail": lambda w, o: {"pk": o["endpoint_key"].pk},
    "endpoint-key-rotate": lambda w, o: {"pk": o["endpoint_key"].pk},
    "gateway-route": lambda w, o: {"pk": o["service"].pk},
    "gateway-backend-detail": lambda w, o: {"pk": o["backend"].pk},
    "alert-channel-detail": lambda w, o: {"pk": o["channel"].pk},
    "alert-channel-test": lambda w, o: {"pk": o["channel"].pk},
    "alert-channel-rotate-secret": lambda w, o: {"pk": o["channel"].pk},
    "alert-channel-deliveries": lambda w, o: {"pk": o["channel"].pk},
    "alert-detail": lambda w, o: {"pk": o["alert"].pk},
    "alert-acknowledge": lambda w, o: {"pk": o["alert"].pk},
    "alert-resolve": lambda w, o: {"pk": o["alert"].pk},
    "slice-detail": lambda w, o: {"pk": o["slice"].pk},
    # the agent's channel: people's keys are refused (403) for any id alike
    "agent-slice-request-detail": lambda w, o: {"pk": o["slice_request"].pk},
    "inference-replica-model-ensure": lambda w, o: {"task_id": o["task"].pk},
}


def missing_kwargs(kwargs: dict) -> dict:
    """The same URL with ids that name nothing (the slug of a tenant, a node id, a pk)."""
    return {name: MISSING_INT if isinstance(value, int) else MISSING_STR for name, value in kwargs.items()}


@pytest.fixture
def acme_objects(world):
    acme = world.tenants["acme"]
    node = make_node("acme-dedicated-node", 2, tenant=acme, name="acme-secret-node")
    group = TenantGroup.objects.create(name="acme-only-group")
    group.tenants.add(acme)
    slice_ = make_slice(node, acme, state="confirmed", device_id="MIG-acme-secret-slice")
    return {
        "node": node,
        "task": make_task(acme, name="acme-secret-task", status="running", node=node),
        "image_request": ImageRequest.objects.create(node=node, action="pull", references=["acme/secret:1"]),
        "group": make_group(acme, 2, 1, name="acme-secret-group"),
        "api_key": ApiKey.objects.filter(tenant=acme).order_by("pk").first(),
        "tenant_group": group,
        "model": Model.objects.create(
            tenant=acme, name="acme-secret-model", source_kind="path", source="/m", format="gguf"
        ),
        "service": make_service(acme, name="acme-secret-service", state="sleeping"),
        "channel": NotificationChannel.objects.create(tenant=acme, name="acme-secret-channel", kind="webhook"),
        "alert": make_alert(tenant=acme, message="acme-secret-alert"),
        "endpoint_key": EndpointKey.objects.create(
            tenant=acme, name="acme-secret-endpoint-key", key_hash="0" * 64, display_prefix="sk-hf-0000"
        ),
        "backend": ExternalBackend.objects.create(
            tenant=acme, model="acme-secret-backend", base_url="https://llm.example.com/v1"
        ),
        "slice": slice_,
        "slice_request": make_slice_request(slice_, "destroy", status="pending"),
    }


# a row hashed without its sign-in bookkeeping (a user's last sign-in, a key's last use)
ROW_HASH = "md5((to_jsonb(t) - ARRAY['last_login', 'last_used_at'])::text)"


def database_fingerprint() -> dict[str, str]:
    """A hash of every row of every table the models map (any write changes it), but the
    sign-in bookkeeping: the sessions the test's sign-ins create, ROW_HASH's columns."""
    digest = {}
    with connection.cursor() as cursor:
        for model in sorted(django_apps.get_models(), key=lambda m: m._meta.db_table):
            table = model._meta.db_table
            cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [table])
            if not cursor.fetchone()[0] or table == "django_session":
                continue  # a tenant app's table (not in public), or sign-in bookkeeping
            cursor.execute(
                f"SELECT md5(coalesce(string_agg({ROW_HASH}, '' ORDER BY {ROW_HASH}), '')) FROM \"{table}\" t"
            )
            digest[table] = cursor.fetchone()[0]
    return digest


def methods_of(view) -> list[str]:
    names = getattr(view, "http_method_names", ["get", "post", "put", "patch", "delete"])
    return [m for m in ("get", "post", "put", "patch", "delete") if m in names and hasattr(view, m)]


def ask(api, world, who: str, method: str, url: str):
    api.logout()
    headers = {}
    if who.endswith("-session"):
        api.force_login(world.users[who.removesuffix("-session")])
    else:
        headers = bearer(world.keys[who])
    if method in ("get", "delete"):
        return getattr(api, method)(url, **headers)
    return getattr(api, method)(url, WRITE_BODY, format="json", **headers)


def test_every_route_with_an_id_is_in_the_matrix():
    unlisted = sorted(
        f"{route} ({name})" for route, name, _ in api_routes() if name not in OWNED and name not in NOT_TENANT_OWNED
    )
    assert not unlisted, (
        "API routes that take an id but are not in the cross-tenant matrix (add each to OWNED with an object of "
        "tenant A, or to NOT_TENANT_OWNED with the reason): " + ", ".join(unlisted)
    )
    gone = sorted((set(OWNED) | set(NOT_TENANT_OWNED)) - {name for _, name, _ in api_routes()})
    assert not gone, f"matrix entries for routes that no longer exist: {gone}"


def test_another_tenant_never_reaches_tenant_as_objects(world, api, acme_objects):
    secrets = [
        "acme-secret-node",
        "acme-secret-task",
        "acme-secret-group",
        "acme-secret-model",
        "acme-secret-service",
        "acme-secret-endpoint-key",
        "acme-secret-backend",
        "acme-secret-channel",
        "acme-secret-alert",
        "acme-only-group",
        "MIG-acme-secret-slice",
    ]
    before = database_fingerprint()
    tried, problems = 0, []
    for _, name, view in sorted(api_routes(), key=lambda r: r[0]):
        if name not in OWNED:
            continue
        kwargs = OWNED[name](world, acme_objects)
        url, nowhere = reverse(name, kwargs=kwargs), reverse(name, kwargs=missing_kwargs(kwargs))
        for method in methods_of(view):
            for who in BETA_PRINCIPALS:
                tried += 1
                answer = ask(api, world, who, method, url)
                baseline = ask(api, world, who, method, nowhere)
                text = answer.content.decode(errors="replace")
                where = f"{who} {method.upper()} {url}"
                if answer.status_code < 300 or answer.status_code in (401,):
                    problems.append(f"{where}: {answer.status_code} (A's object served)")
                elif answer.status_code != baseline.status_code:
                    problems.append(
                        f"{where}: {answer.status_code}, but {baseline.status_code} for an id that does not exist"
                    )
                elif any(secret in text for secret in secrets):
                    problems.append(f"{where}: the answer names A's object")
    assert not problems, f"{len(problems)} of {tried} requests:\n" + "\n".join(problems)
    after = database_fingerprint()
    assert after == before, f"refused requests changed {sorted(t for t in after if after[t] != before.get(t))}"
    assert tried >= len(BETA_PRINCIPALS) * len(OWNED)
