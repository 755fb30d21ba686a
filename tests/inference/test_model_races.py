"""Registry writes at the same moment, on real connections: one name per tenant however
many ask for it at once, and a node deleted while a model is being pinned on it never
leaves a model registered on a node that is gone."""

import pytest
from rest_framework.exceptions import ValidationError

from apps.core.errors import Conflict
from apps.core.principals import Principal, PrincipalKind
from apps.inference import services
from apps.inference.models import Model
from apps.nodes import services as node_services
from apps.nodes.models import Node
from apps.tenants import services as tenant_services
from tests.concurrency import together
from tests.factories import make_node

pytestmark = pytest.mark.django_db(transaction=True)

OPERATOR = Principal(PrincipalKind.OPERATOR)


def body(tenant, **fields) -> dict:
    return {
        "tenant": tenant.slug,
        "name": "qwen3-8b",
        "source_kind": "hub",
        "source": "Qwen/Qwen3-8B",
        "format": "safetensors",
        "size_bytes": None,
        "engines": [],
        "nodes": [],
        **fields,
    }


@pytest.fixture
def tenant():
    tenant = tenant_services.create_tenant(name="Model Race", slug="model-race")
    yield tenant
    Model.objects.filter(tenant=tenant).delete()
    Node.objects.filter(pk="race-1").delete()
    tenant_services.delete_tenant(tenant)


def test_concurrent_registrations_of_one_name_make_one_model(tenant):
    def register(i):
        try:
            services.register_model(OPERATOR, body(tenant, size_bytes=i))
            return "created"
        except Conflict as exc:
            assert exc.get_codes() == "model_exists"
            return "refused"

    assert sorted(together(4, register)) == ["created", "refused", "refused", "refused"]
    assert Model.objects.filter(tenant=tenant).count() == 1


@pytest.mark.parametrize("round", range(3))
def test_a_node_deleted_while_a_model_is_pinned_on_it_never_keeps_a_dangling_registration(tenant, round):
    node = make_node("race-1", 1)

    def work(i):
        try:
            if i == 0:
                node_services.delete_node(node)
                return "deleted"
            services.register_model(OPERATOR, body(tenant, nodes=["race-1"]))
            return "registered"
        except Conflict as exc:
            return exc.get_codes()
        except ValidationError as exc:
            return "nodes" if "nodes" in exc.detail else exc.detail

    outcomes = sorted(together(2, work))
    node_exists = Node.objects.filter(pk="race-1").exists()
    models = list(Model.objects.filter(tenant=tenant))
    # either the registration came first (the delete is refused, naming it) or the delete
    # did (the registration is refused on `nodes`, and nothing of it is written)
    assert outcomes in (["node_has_models", "registered"], ["deleted", "nodes"]), outcomes
    if outcomes == ["deleted", "nodes"]:
        assert not node_exists and models == []
    else:
        assert node_exists and [list(m.nodes.values_list("pk", flat=True)) for m in models] == [["race-1"]]
