"""Where a model is cached: joined from the nodes' discovered models and their
heteroflow.cache/models label, by name or path, among the nodes its tenant may use."""

import pytest

from apps.inference import selectors
from apps.inference.models import Model
from apps.nodes.model_cache import CACHED_MODELS_LABEL, label_models, node_models
from apps.nodes.models import Node
from tests.factories import make_node
from tests.headers import bearer

pytestmark = pytest.mark.django_db

PATH = "/data/heteroflow/model-cache/Qwen3-8B"


def scanned(name, path, **extra):
    return {"name": name, "path": path, "size_bytes": 1000, "format": "safetensors", **extra}


@pytest.fixture
def model(world):
    return Model.objects.create(
        tenant=world.tenants["acme"], name="qwen3-8b", source_kind="path", source=PATH + "/", format="safetensors"
    )


def test_label_entries_are_comma_separated_or_a_json_array():
    assert label_models({CACHED_MODELS_LABEL: " a, b ,,a, /x/y "}) == ["a", "b", "/x/y"]
    assert label_models({CACHED_MODELS_LABEL: '["a", "b", 3]'}) == ["a", "b"]
    assert label_models({CACHED_MODELS_LABEL: "[not json, c"}) == ["[not json", "c"]
    assert label_models({CACHED_MODELS_LABEL: ""}) == label_models({}) == label_models(None) == []


def test_matched_by_path_by_name_and_by_label_on_the_nodes_the_tenant_may_use(world, model):
    make_node("by-path", discovered_models=[scanned("Qwen3-8B", PATH)])
    make_node("by-name", discovered_models=[scanned("qwen3-8b", "/models/q")])
    make_node("by-label", labels={CACHED_MODELS_LABEL: "llama-3, qwen3-8b"})
    make_node("by-label-path", labels={CACHED_MODELS_LABEL: PATH})
    make_node("own", tenant=world.tenants["acme"], discovered_models=[scanned("x", PATH + "/")])
    # never: another tenant's dedicated node, a near name, a longer path, another label
    make_node("beta", tenant=world.tenants["beta"], discovered_models=[scanned("qwen3-8b", PATH)])
    make_node("near", discovered_models=[scanned("qwen3-8b-instruct", PATH + "-Instruct")])
    make_node("other-label", labels={CACHED_MODELS_LABEL: "qwen3-8b-awq", "zone": "qwen3-8b"})
    make_node("nothing")
    found = selectors.cached_on([model])[model.pk]
    assert [c["node_id"] for c in found] == ["by-label", "by-label-path", "by-name", "by-path", "own"]
    by = {c["node_id"]: c for c in found}
    assert by["by-path"]["paths"] == [PATH] and not by["by-path"]["labelled"]
    assert by["by-label"]["paths"] == [] and by["by-label"]["labelled"]
    assert by["own"]["status"] == "online"


def test_a_hub_model_matches_its_hub_id_in_the_label_and_an_image_model_only_its_name(world):
    acme = world.tenants["acme"]
    hub = Model.objects.create(tenant=acme, name="q", source_kind="hub", source="Qwen/Qwen3-8B", format="safetensors")
    image = Model.objects.create(tenant=acme, name="i", source_kind="image", source="reg/qwen:1", format="safetensors")
    make_node("served", labels={CACHED_MODELS_LABEL: "Qwen/Qwen3-8B,reg/qwen:1"})
    make_node("scanned", discovered_models=[scanned("i", "/m/i")])
    found = selectors.cached_on([hub, image])
    assert [c["node_id"] for c in found[hub.pk]] == ["served"]
    assert [c["node_id"] for c in found[image.pk]] == ["scanned"]


def test_one_query_for_the_nodes_whatever_the_number_of_models(world, django_assert_num_queries):
    models = [
        Model.objects.create(tenant=world.tenants["acme"], name=f"m{i}", source_kind="hub", source="o", format="gguf")
        for i in range(20)
    ]
    make_node("n", labels={CACHED_MODELS_LABEL: ",".join(f"m{i}" for i in range(0, 20, 2))})
    with django_assert_num_queries(1):
        found = selectors.cached_on(models)
    assert [m.name for m in models if found[m.pk]] == [f"m{i}" for i in range(0, 20, 2)]


def test_the_api_shows_cached_on_in_the_list_and_the_detail(api, world, model):
    make_node("n1", discovered_models=[scanned("Qwen3-8B", PATH)], status="offline")
    key = bearer(world.keys["acme-viewer"])
    listed = api.get("/api/v1/models", **key).json()["results"]
    assert listed[0]["cached_on"] == [
        {
            "node_id": "n1",
            "node_name": "n1",
            "status": "offline",
            "paths": [PATH],
            "labelled": False,
            "served_by_tasks": [],
        }
    ]
    assert api.get(f"/api/v1/models/{model.pk}", **key).json()["cached_on"][0]["node_id"] == "n1"


def test_the_node_page_reading_lists_label_entries_the_scan_did_not_find(world):
    node = make_node("n", discovered_models=[scanned("a", "/m/a"), "junk"], labels={CACHED_MODELS_LABEL: "a, /m/a, b"})
    node = Node.objects.get(pk=node.pk)
    assert [(m["name"], m["path"]) for m in node_models(node)] == [("a", "/m/a"), ("b", "")]


def test_a_model_an_engine_has_loaded_names_the_tasks_serving_it(world, model):
    make_node(
        "serving",
        discovered_models=[
            scanned("Qwen3-8B", PATH, served=True, task_id=41, port=8001),
            {"name": "qwen3-8b", "path": "qwen3-8b", "served": True, "task_id": 42, "port": 8002},
            {"name": "qwen3-8b", "path": "/elsewhere", "served": False, "task_id": 43},
        ],
    )
    (found,) = selectors.cached_on([model])[model.pk]
    assert found["served_by_tasks"] == [41, 42] and found["paths"] == [PATH, "/elsewhere", "qwen3-8b"]
