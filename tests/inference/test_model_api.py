"""The model registry's API: a strict body whose every refusal writes nothing, one name
per tenant (409), another tenant's model answering 404, who may change what, paging and
the filters, PATCH of what may change."""

import pytest

from apps.inference.choices import Engine
from apps.inference.models import Model
from heteroflow_agent import inventory
from heteroflow_agent.engines import router
from tests.factories import make_node
from tests.headers import bearer

pytestmark = pytest.mark.django_db

URL = "/api/v1/models"
BODY = {
    "name": "qwen3-8b",
    "source_kind": "path",
    "source": "/data/heteroflow/model-cache/Qwen3-8B",
    "format": "safetensors",
    "size_bytes": 16_000_000_000,
    "engines": ["vllm", "sglang"],
}


def post(api, key, body, **extra):
    return api.post(URL, body, format="json", **bearer(key), **extra)


@pytest.fixture
def nodes(world):
    return {
        "shared": make_node("shared-1", 2),
        "acme": make_node("acme-1", 2, tenant=world.tenants["acme"]),
        "beta": make_node("beta-1", 2, tenant=world.tenants["beta"]),
    }


def test_a_member_registers_a_model_and_reads_it_back(api, world, nodes):
    response = post(api, world.keys["acme-member"], {**BODY, "nodes": ["acme-1", "shared-1"]})
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["tenant"] == "acme" and body["name"] == "qwen3-8b" and body["engines"] == ["vllm", "sglang"]
    assert body["nodes"] == ["acme-1", "shared-1"] and body["cached_on"] == []
    model = Model.objects.get(pk=body["id"])
    assert model.size_bytes == 16_000_000_000 and sorted(model.nodes.values_list("pk", flat=True)) == [
        "acme-1",
        "shared-1",
    ]
    detail = api.get(f"{URL}/{model.pk}", **bearer(world.keys["acme-viewer"]))
    assert detail.status_code == 200 and detail.json()["source"] == BODY["source"]


@pytest.mark.parametrize(
    "change,field",
    [
        ({"surprise": 1}, "surprise"),
        ({"name": "has space"}, "name"),
        ({"name": ""}, "name"),
        ({"source_kind": "ftp"}, "source_kind"),
        ({"source": "relative/path"}, "source"),
        ({"source": "/data/../etc"}, "source"),
        ({"source_kind": "image", "source": "Registry/UPPER CASE:tag"}, "source"),
        ({"source_kind": "hub", "source": "org/name/extra"}, "source"),
        ({"format": "zip"}, "format"),
        ({"size_bytes": -1}, "size_bytes"),
        ({"engines": ["vllm", "warp-drive"]}, "engines"),
        ({"engines": ["vllm", "vllm"]}, "engines"),
        ({"engines": "vllm"}, "engines"),
        ({"nodes": ["shared-1", "shared-1"]}, "nodes"),
        ({"nodes": ["no-such-node"]}, "nodes"),
        ({"nodes": ["beta-1"]}, "nodes"),  # another tenant's dedicated node reads as unknown
        ({"tenant": "nope"}, None),  # 404: not a tenant of the caller
    ],
)
def test_each_bad_body_is_refused_naming_the_field_and_writes_nothing(api, world, nodes, change, field):
    response = post(api, world.keys["acme-member"], {**BODY, **change})
    if field is None:
        assert response.status_code == 404
    else:
        assert response.status_code == 400, response.content
        assert field in response.json()["error"]["fields"], response.json()
    assert not Model.objects.exists()


def test_missing_fields_are_named(api, world):
    response = post(api, world.keys["acme-member"], {"name": "x"})
    assert response.status_code == 400
    assert set(response.json()["error"]["fields"]) == {"source_kind", "source", "format"}
    assert not Model.objects.exists()


def test_image_and_hub_sources_in_their_shapes_are_accepted(api, world):
    image = {**BODY, "name": "img", "source_kind": "image", "source": "registry.local:5000/models/qwen:3-8b"}
    hub = {**BODY, "name": "Qwen/Qwen3-8B", "source_kind": "hub", "source": "Qwen/Qwen3-8B", "engines": []}
    gguf = {**BODY, "name": "tiny:q4", "format": "gguf", "engines": ["llama.cpp"], "size_bytes": None}
    for body in (image, hub, gguf):
        assert post(api, world.keys["acme-member"], body).status_code == 201, body
    assert Model.objects.filter(tenant=world.tenants["acme"]).count() == 3


def test_a_name_is_unique_per_tenant_not_across_tenants(api, world):
    assert post(api, world.keys["acme-member"], BODY).status_code == 201
    again = post(api, world.keys["acme-admin"], {**BODY, "format": "gguf"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "model_exists"
    assert "qwen3-8b" in again.json()["error"]["message"]
    assert post(api, world.keys["beta-member"], BODY).status_code == 201
    assert Model.objects.count() == 2


def test_viewers_cannot_register_change_or_delete(api, world):
    refused = post(api, world.keys["acme-viewer"], BODY)
    assert refused.status_code == 403 and not Model.objects.exists()
    model = Model.objects.create(tenant=world.tenants["acme"], name="m", source_kind="hub", source="a/b", format="gguf")
    key = bearer(world.keys["acme-viewer"])
    assert api.patch(f"{URL}/{model.pk}", {"size_bytes": 1}, format="json", **key).status_code == 403
    assert api.delete(f"{URL}/{model.pk}", **key).status_code == 403
    model.refresh_from_db()
    assert model.size_bytes is None


def test_operators_register_for_a_named_tenant_only(api, world):
    unnamed = post(api, world.operator_key, BODY)
    assert unnamed.status_code == 400 and "tenant" in unnamed.json()["error"]["fields"]
    named = post(api, world.operator_key, {**BODY, "tenant": "beta"})
    assert named.status_code == 201 and named.json()["tenant"] == "beta"


def test_another_tenants_model_is_not_found(api, world):
    model = Model.objects.create(tenant=world.tenants["beta"], name="m", source_kind="hub", source="a/b", format="gguf")
    key = bearer(world.keys["acme-admin"])
    assert api.get(f"{URL}/{model.pk}", **key).status_code == 404
    assert api.patch(f"{URL}/{model.pk}", {"size_bytes": 1}, format="json", **key).status_code == 404
    assert api.delete(f"{URL}/{model.pk}", **key).status_code == 404
    assert api.get(URL, **key).json()["count"] == 0
    assert Model.objects.filter(pk=model.pk, size_bytes=None).exists()


def test_the_list_pages_by_name_and_filters_by_format_and_engine(api, world):
    acme = world.tenants["acme"]
    for index in range(5):
        Model.objects.create(
            tenant=acme,
            name=f"m{index}",
            source_kind="hub",
            source=f"org/m{index}",
            format="gguf" if index % 2 else "safetensors",
            engines=["llama.cpp"] if index % 2 else ["vllm", "sglang"],
        )
    Model.objects.create(tenant=world.tenants["beta"], name="other", source_kind="hub", source="o/o", format="gguf")
    key = bearer(world.keys["acme-viewer"])
    first = api.get(URL, {"limit": 2}, **key).json()
    second = api.get(URL, {"limit": 2, "offset": 2}, **key).json()
    assert first["count"] == 5 and [m["name"] for m in first["results"]] == ["m0", "m1"]
    assert [m["name"] for m in second["results"]] == ["m2", "m3"] and second["previous"]
    assert [m["name"] for m in api.get(URL, {"model_format": "gguf"}, **key).json()["results"]] == ["m1", "m3"]
    assert [m["name"] for m in api.get(URL, {"engine": "sglang"}, **key).json()["results"]] == ["m0", "m2", "m4"]
    assert api.get(URL, {"engine": "mindie"}, **key).json()["count"] == 0
    for bad in ({"engine": "warp"}, {"model_format": "zip"}, {"limit": 0}, {"colour": "red"}):
        response = api.get(URL, bad, **key)
        assert response.status_code == 400 and set(bad) <= set(response.json()["error"]["fields"]), bad
    assert api.get(URL, **bearer(world.operator_key)).json()["count"] == 6


def test_patch_changes_size_engines_and_nodes_and_refuses_the_rest(api, world, nodes):
    model = Model.objects.create(
        tenant=world.tenants["acme"], name="m", source_kind="path", source="/m", format="gguf", engines=["llama.cpp"]
    )
    model.nodes.set([nodes["shared"]])
    url, key = f"{URL}/{model.pk}", bearer(world.keys["acme-member"])
    change = {"size_bytes": 42, "engines": ["llama.cpp", "ollama"], "nodes": ["acme-1"]}
    changed = api.patch(url, change, format="json", **key)
    assert changed.status_code == 200, changed.content
    assert changed.json()["nodes"] == ["acme-1"] and changed.json()["engines"] == ["llama.cpp", "ollama"]
    model.refresh_from_db()
    assert model.size_bytes == 42 and list(model.nodes.values_list("pk", flat=True)) == ["acme-1"]
    unpinned = api.patch(url, {"nodes": []}, format="json", **key)
    assert unpinned.status_code == 200 and unpinned.json()["nodes"] == [] and unpinned.json()["size_bytes"] == 42
    for bad, field in (
        ({"name": "renamed"}, "name"),
        ({"format": "onnx", "size_bytes": 1}, "format"),
        ({"engines": ["nope"]}, "engines"),
        ({"nodes": ["beta-1"]}, "nodes"),
        ({"colour": "red"}, "colour"),
    ):
        response = api.patch(url, bad, format="json", **key)
        assert response.status_code == 400 and field in response.json()["error"]["fields"], (bad, response.json())
        if field in ("name", "format"):
            assert response.json()["error"]["fields"][field] == ["Cannot be changed; register a new model instead."]
    empty = api.patch(url, {}, format="json", **key)
    assert empty.status_code == 400 and "Nothing to change" in empty.json()["error"]["message"]
    model.refresh_from_db()
    assert (model.name, model.format, model.size_bytes, model.engines) == ("m", "gguf", 42, ["llama.cpp", "ollama"])
    assert not model.nodes.exists()


def test_delete_removes_the_model_and_its_registrations(api, world, nodes):
    model = Model.objects.create(tenant=world.tenants["acme"], name="m", source_kind="hub", source="a/b", format="gguf")
    model.nodes.set([nodes["shared"]])
    assert api.delete(f"{URL}/{model.pk}", **bearer(world.keys["acme-member"])).status_code == 204
    assert not Model.objects.exists() and not nodes["shared"].registered_models.exists()
    assert api.delete(f"{URL}/{model.pk}", **bearer(world.keys["acme-member"])).status_code == 404


def test_every_engine_the_agent_can_report_or_route_is_a_known_engine():
    assert set(inventory.ENGINE_IMAGES) | set(router.ROUTED_ENGINES) <= set(Engine.values)
