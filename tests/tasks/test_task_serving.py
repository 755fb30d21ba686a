"""A task's `serving` (what the agent's engine router launches for an inference task):
shown with the task, accepted on create for kind inference only and in a strict shape,
refused (400, nothing written) otherwise. The thin create route answers the same
(tests/tasks/test_task_create_route.py compares the two paths case by case)."""

import pytest

from apps.inference.choices import Engine, ModelFormat
from apps.tasks.api.serializers import ServingSerializer
from apps.tasks.models import Task
from tests.factories import make_task
from tests.headers import bearer

pytestmark = pytest.mark.django_db

INFERENCE = {"name": "chat", "image": "auto", "kind": "inference", "gpu_required": 1}
SERVING = {
    "engine": "vllm",
    "model": "qwen-7b",
    "format": "safetensors",
    "source": "/models/qwen-7b",
    "args": ["--max-model-len", "4096"],
}


def create(api, world, **changes):
    return api.post("/api/v1/tasks", INFERENCE | changes, format="json", **bearer(world.keys["acme-member"]))


def test_an_inference_task_is_created_with_its_serving_and_shows_it(api, world):
    response = create(api, world, serving=SERVING)
    assert response.status_code == 201, response.content
    assert response.json()["serving"] == SERVING
    assert Task.objects.get(pk=response.json()["id"]).serving == SERVING
    shown = api.get(f"/api/v1/tasks/{response.json()['id']}", **bearer(world.keys["acme-member"])).json()
    assert shown["serving"] == SERVING


def test_engine_and_args_have_defaults_and_serving_may_be_left_out(api, world):
    response = create(api, world, serving={"model": "tiny", "format": "gguf", "source": "/models/tiny.gguf"})
    assert response.status_code == 201, response.content
    assert response.json()["serving"] == {
        "engine": "auto",
        "model": "tiny",
        "format": "gguf",
        "source": "/models/tiny.gguf",
        "args": [],
    }
    plain = create(api, world)
    assert plain.status_code == 201 and plain.json()["serving"] == {}
    assert make_task(world.tenants["acme"]).serving == {}


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"kind": "job", "serving": SERVING}, "serving"),
        ({"kind": "training", "serving": SERVING}, "serving"),
        ({"kind": "job", "serving": {}}, "serving"),
        ({"serving": SERVING | {"format": "pickle"}}, "serving"),
        ({"serving": SERVING | {"engine": "warp-drive"}}, "serving"),
        ({"serving": SERVING | {"engine": 3}}, "serving"),
        ({"serving": SERVING | {"args": "--max-model-len 4096"}}, "serving"),
        ({"serving": SERVING | {"args": [["nested"]]}}, "serving"),
        ({"serving": SERVING | {"quantisation": "int4"}}, "serving"),
        ({"serving": {key: value for key, value in SERVING.items() if key != "model"}}, "serving"),
        ({"serving": {key: value for key, value in SERVING.items() if key != "source"}}, "serving"),
        ({"serving": SERVING | {"model": ""}}, "serving"),
        ({"serving": None}, "serving"),
        ({"serving": "vllm qwen"}, "serving"),
        ({"serving": [SERVING]}, "serving"),
    ],
)
def test_serving_is_refused_for_other_kinds_and_bad_shapes_and_nothing_is_written(api, world, changes, field):
    before = Task.objects.count()
    response = create(api, world, **changes)
    assert response.status_code == 400, response.content
    assert field in response.json()["error"]["fields"], response.json()
    assert Task.objects.count() == before


def test_the_messages_name_what_is_allowed(api, world):
    fields = create(api, world, serving=SERVING | {"format": "pickle", "engine": "warp", "colour": 1}).json()
    problems = fields["error"]["fields"]["serving"]
    assert "is not a model format: one of safetensors, gguf" in problems["format"][0]
    assert 'is not an engine: "auto" or one of vllm' in problems["engine"][0]
    assert problems["colour"] == ["Unknown field."]
    job = create(api, world, kind="job", serving=SERVING).json()["error"]["fields"]["serving"]
    assert job == ["Only inference tasks have a serving spec."]


def test_the_formats_and_engines_are_the_registrys():
    """The tasks' create body takes the registry's vocabularies (apps.inference.choices,
    the schema layer any app may use), so the two cannot drift apart."""
    fields = ServingSerializer().fields
    assert list(fields["format"].choices) == list(ModelFormat.values)
    assert list(fields["engine"].choices) == ["auto", *Engine.values]
