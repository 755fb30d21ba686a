"""The gateway's live fixtures: stand-in upstreams and the gateway's route, each under
uvicorn in a thread (module-wide), and per test a committed tenant with an endpoint key
and services whose replicas are the stand-ins. The route reads committed rows on its own
connections, so the tests using these are transactional."""

from __future__ import annotations

import itertools
import time

import pytest
import redis
from django.conf import settings
from django.core.asgi import get_asgi_application

from apps.core.principals import Principal, PrincipalKind
from apps.gateway import services as gateway_services
from apps.gateway.api.route import GatewayApp
from apps.gateway.models import UsageBucket
from apps.inference.models import InferenceService, Model
from apps.tasks.models import Task, TaskGroup
from apps.tenants import services
from apps.tenants.choices import Role
from tests.factories import UserFactory, make_node, make_task
from tests.gateway.upstream import Served, Upstream

_numbers = itertools.count(1)


MINUTE_MARGIN_SECONDS = 10


@pytest.fixture
def one_minute():
    """For a test that counts requests or tokens in the limits' fixed one-minute window:
    it starts at least MINUTE_MARGIN_SECONDS before the minute turns, so all its requests
    fall in one window (a turn between two requests resets the count it checks)."""
    left = 60 - time.time() % 60
    if left < MINUTE_MARGIN_SECONDS:
        time.sleep(left + 0.05)


@pytest.fixture(scope="module")
def upstreams():
    served = {name: Served(Upstream(name)) for name in ("a", "b", "c")}
    yield served
    for one in served.values():
        one.stop()


@pytest.fixture(scope="module")
def gateway():
    redis.Redis.from_url(settings.REDIS_URL).flushdb()
    app = GatewayApp(get_asgi_application())
    served = Served(app)
    yield served
    served.call(app.close())
    served.stop()


@pytest.fixture(autouse=True)
def fresh(request):
    """Each test starts with empty caches, no backend out of rotation, empty stand-ins."""
    if "gateway" in request.fixturenames:
        gateway = request.getfixturevalue("gateway")
        gateway.app.catalog.clear()
        gateway.app.catalog._quarantine.clear()
    if "upstreams" in request.fixturenames:
        for one in request.getfixturevalue("upstreams").values():
            one.app.reset()
    yield


class Tenancy:
    def __init__(self):
        n = next(_numbers)
        self.tenant = services.create_tenant(name=f"Gw{n}", slug=f"gw{n}")
        self.user = UserFactory(username=f"gw{n}-member")
        services.add_member(self.tenant, username=self.user.username, role=Role.MEMBER)
        self.principal = Principal(PrincipalKind.TENANT_USER, user=self.user, tenant=self.tenant, role=Role.MEMBER)
        self.tenant_key = services.issue_tenant_key(
            principal=self.principal, tenant=self.tenant, owner=self.user, name="t"
        ).key
        self.node = make_node(f"gw{n}-node", 0, ip="127.0.0.1")

    def key(self, **fields):
        issued = gateway_services.create_key(self.principal, tenant=self.tenant, name=fields.pop("name", "k"), **fields)
        return issued.endpoint_key, issued.key

    def model(self, name: str) -> Model:
        return Model.objects.filter(tenant=self.tenant, name=name).first() or Model.objects.create(
            tenant=self.tenant, name=name, source_kind="path", source="/m", format="gguf"
        )

    def service(self, model: str, upstreams, *, state="running", healthy=True, gpus=1) -> InferenceService:
        """A service of `model` whose replicas (ranks in order) are these stand-ins,
        running on this tenant's local node, healthy (or not: `healthy` a bool or a list),
        each asking for `gpus` cards."""
        registered = self.model(model)
        n = len(upstreams)
        group = TaskGroup.objects.create(
            tenant=self.tenant,
            name=f"{model}-{next(_numbers)}",
            kind="inference",
            placement="replicas",
            world_size=max(n, 1),
            gpus_per_worker=max(gpus, 1),
            gpu_type="nvidia",
            image="auto",
        )
        service = InferenceService.objects.create(
            group=group, model=registered, min_replicas=n, max_replicas=max(n, 1), replicas=n, state=state
        )
        flags = healthy if isinstance(healthy, list) else [healthy] * n
        health = list(self.node.task_health)
        for rank, (upstream, ok) in enumerate(zip(upstreams, flags, strict=True)):
            task = make_task(
                self.tenant,
                name=f"{group.name}-{rank}",
                group=group,
                rank=rank,
                kind="inference",
                status="running",
                node=self.node,
                host_port=upstream.port,
                gpu_required=gpus,
            )
            health.append({"task_id": task.id, "healthy": ok})
        self.node.task_health = health
        self.node.save(update_fields=["task_health"])
        return service

    def close(self):
        InferenceService.objects.filter(group__tenant=self.tenant).delete()
        Task.objects.filter(tenant=self.tenant).delete()
        TaskGroup.objects.filter(tenant=self.tenant).delete()
        Model.objects.filter(tenant=self.tenant).delete()
        self.node.delete()
        # Usage rows first: deleting two keys that share a minute's bucket would set both
        # rows' key to NULL, one bucket twice (gateway_usage_bucket_unique)
        UsageBucket.objects.filter(tenant=self.tenant).delete()
        services.delete_tenant(self.tenant)


@pytest.fixture
def tenancy(request):
    made = Tenancy()
    yield made
    if "gateway" in request.fixturenames:
        # the usage the test's requests gathered is written now: a periodic flush during
        # the deletes below would insert usage of a tenant being deleted. A request
        # reaches the meter after its answer has gone, so flush until nothing more comes.
        gateway = request.getfixturevalue("gateway")
        deadline = time.monotonic() + 5
        while True:
            gateway.call(gateway.app.meter.flush())
            time.sleep(0.1)
            if not gateway.app.meter.buckets or time.monotonic() > deadline:
                break
        gateway.call(gateway.app.meter.flush())
    made.close()
