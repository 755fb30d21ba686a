"""GET /api/v1/schemas/jobs: the job file's JSON Schema (apps.core.jobs_schema), which `hf`
and the SDK check every document against before they send it. It is public (wrong
credentials are still 401), cached by its ETag, built from the server's own choices and
limits, and held to the API: every body the API accepts here, the schema accepts as a
document; every body the API refuses here (an unknown field included), the schema refuses,
naming the same field."""

from __future__ import annotations

import pytest
from django.test import override_settings
from jsonschema import Draft202012Validator

from apps.inference.choices import Engine, ModelFormat
from apps.nodes.choices import GpuVendor
from apps.tasks.choices import MAX_GPUS_PER_TASK, MAX_PRIORITY, MIN_PRIORITY, GroupStrategy, TaskKind
from tests.headers import bearer
from tests.inference.services_helpers import make_model

pytestmark = pytest.mark.django_db

URL = "/api/v1/schemas/jobs"
ENDPOINTS = {"task": "/api/v1/tasks", "group": "/api/v1/task-groups", "service": "/api/v1/inference-services"}
TASK = {"kind": "task", "name": "hello", "image": "busybox", "command": ["echo", "hi"], "gpu_required": 0}
GROUP = {"kind": "group", "name": "train", "world_size": 2, "gpu_type": "nvidia", "image": "trainer:1"}
SERVICE = {"kind": "service", "name": "chat", "model": "qwen3-8b", "gpu_type": "nvidia"}


def schema_of(api) -> dict:
    response = api.get(URL)
    assert response.status_code == 200, response.content
    return response.json()


def payload(document: dict) -> tuple[str, dict]:
    """The document as the API's create: the endpoint, the body (a task's `task_kind` is
    its `kind`; an array goes to /tasks/batch)."""
    body = {("kind" if key == "task_kind" else key): value for key, value in document.items() if key != "kind"}
    url = ENDPOINTS[document["kind"]]
    if document["kind"] == "task" and "array" in document:
        url += "/batch"
    return url, body


def problems(schema: dict, document: dict) -> list[str]:
    """The fields the schema refuses, named as the API names them (a.b[0].c)."""
    names = []
    for error in Draft202012Validator(schema).iter_errors(document):
        path = list(error.absolute_path)
        if error.validator == "additionalProperties":
            known = set(error.schema.get("properties", {}))
            path += [key for key in error.instance if key not in known][:1]
        if error.validator == "required":
            path += [name for name in error.validator_value if name not in error.instance][:1]
        name = ""
        for step in path:
            name += f"[{step}]" if isinstance(step, int) else (f".{step}" if name else str(step))
        names.append(name)
    return names


def test_the_schema_is_public_draft_2020_12_and_answers_304_to_its_etag(api, world):
    response = api.get(URL)
    assert response.status_code == 200 and response["Content-Type"].startswith("application/json")
    schema = response.json()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)
    etag = response["ETag"]
    assert api.get(URL, HTTP_IF_NONE_MATCH=etag).status_code == 304
    assert api.get(URL, HTTP_IF_NONE_MATCH='"something-else"').status_code == 200
    assert api.get(URL, **bearer(world.keys["acme-viewer"])).json() == schema
    assert api.get(URL, **bearer("sk-tenant-never-issued")).status_code == 401


def test_the_choices_and_limits_are_the_servers_own(api, world):
    defs = schema_of(api)["$defs"]
    task, group, service = (defs[kind]["properties"] for kind in ("task", "group", "service"))
    assert task["task_kind"]["enum"] == TaskKind.values
    assert task["gpu_required"]["maximum"] == MAX_GPUS_PER_TASK
    assert (task["priority"]["minimum"], task["priority"]["maximum"]) == (MIN_PRIORITY, MAX_PRIORITY)
    assert task["serving"]["properties"]["format"]["enum"] == ModelFormat.values
    assert group["gpu_type"]["enum"] == GpuVendor.values
    assert group["strategy"]["enum"] == GroupStrategy.values
    # the document's kind; a group's own (only training can be submitted) is left to the server
    assert group["kind"] == {"const": "group"} and "group_kind" not in group
    assert service["engine"]["enum"] == ["auto", *Engine.values]
    for kind in ("task", "group", "service"):
        assert defs[kind]["additionalProperties"] is False
    with override_settings(HETEROFLOW_GROUP_MAX_WORLD_SIZE=8, HETEROFLOW_TASK_BATCH_MAX=20):
        defs = schema_of(api)["$defs"]
        assert defs["group"]["properties"]["world_size"]["maximum"] == 8
        assert defs["service"]["properties"]["max_replicas"]["maximum"] == 8
        assert defs["task"]["properties"]["array"]["properties"]["count"]["maximum"] == 20


ACCEPTED = {
    "a task": TASK,
    "a task with everything": {
        **TASK,
        "task_kind": "training",
        "env": {"EPOCHS": "3", "_X": ""},
        "volumes": [{"host": "/data", "container": "/data", "read_only": True}],
        "ports": [8080],
        "gpu_required": 2,
        "gpu_memory_mb": 20480,
        "gpu_type": "nvidia",
        "cpu_request": 1.5,
        "memory_request_mb": 4096,
        "priority": 100,
        "labels": {"team": "nlp", "empty": ""},
        "timeout_seconds": 3600,
        "checkpoint_path": "/ckpt",
    },
    "an inference task": {
        **TASK,
        "task_kind": "inference",
        "preemptible": True,
        "health_probe": {"type": "http", "port": 8000},
        "serving": {"model": "m", "format": "gguf", "source": "/models/m.gguf"},
    },
    "an array": {**TASK, "array": {"count": 3}},
    "a process task without an image": {
        **{key: value for key, value in TASK.items() if key != "image"},
        "runtime": "process",
    },
    "a task with hard constraints": {
        **TASK,
        "runtime": "container",
        "affinity": {"nodes_with_labels": {"gpu-pool": "a100", "topology.example/zone": "z1"}},
        "anti_affinity": {"labels": {"maintenance": "soon"}, "same_service": False},
    },
    "a group with hard constraints": {
        **GROUP,
        "runtime": "container",
        "affinity": {"nodes_with_labels": {"fabric": "ib"}},
        "anti_affinity": {"labels": {"maintenance": "soon"}},
    },
    "a group": GROUP,
    "a group with everything": {
        **GROUP,
        "strategy": "fsdp",
        "gpus_per_worker": 8,
        "command": ["torchrun", "train.py"],
        "env": {"NCCL_DEBUG": "INFO"},
        "volumes": [{"host": "/data/ckpt", "container": "/ckpt"}],
        "checkpoint_path": "/ckpt/llm",
        "priority": 70,
        "labels": {"run": "7"},
        "timeout_seconds": 600,
    },
    "a service": SERVICE,
    "a service with everything": {
        **SERVICE,
        "engine": "vllm",
        "gpus_per_replica": 2,
        "gpu_memory_mb": 40000,
        "memory_request_mb": 8000,
        "min_replicas": 1,
        "max_replicas": 3,
        "engine_args": ["--max-model-len", "4096"],
        "health_probe": {"type": "tcp", "port": 8000},
        "autoscaling": {"target_in_flight": 4},
        "window": {
            "days": ["mon", "tue"],
            "ranges": [{"start": "08:00", "end": "20:00"}],
            "timezone": "UTC",
            "action": "scale",
            "scale_to": 1,
        },
        "sleep_after_seconds": 60,
        "image": "auto",
        "env": {"A": "b"},
        "priority": 10,
        "labels": {"x": "y"},
    },
}


@pytest.mark.parametrize("document", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_what_the_api_accepts_the_schema_accepts(api, world, document):
    make_model(world.tenants["acme"])
    url, body = payload(document)
    response = api.post(url, body, format="json", **bearer(world.keys["acme-admin"]))
    assert response.status_code == 201, response.json()
    assert problems(schema_of(api), document) == []


REFUSED = {
    "an unknown field": ({**TASK, "colour": "red"}, "colour"),
    "an unknown field in a volume": (
        {**TASK, "volumes": [{"host": "/a", "container": "/b", "rw": True}]},
        "volumes[0].rw",
    ),
    "too many gpus": ({**TASK, "gpu_required": MAX_GPUS_PER_TASK + 1}, "gpu_required"),
    "a priority over the top": ({**TASK, "priority": MAX_PRIORITY + 1}, "priority"),
    "no image": ({key: value for key, value in TASK.items() if key != "image"}, "image"),
    "a blank name": ({**TASK, "name": "  "}, "name"),
    "an unknown task kind": ({**TASK, "task_kind": "batch"}, "task_kind"),
    "an env name that is not a name": ({**TASK, "env": {"1BAD": "x"}}, "env"),
    "an env value that is a number": ({**TASK, "env": {"PORT": 8080}}, "env.PORT"),
    "a preemptible training task": ({**TASK, "task_kind": "training", "preemptible": True}, "preemptible"),
    "a serving spec on a job": ({**TASK, "serving": {"model": "m", "format": "gguf", "source": "/m"}}, "serving"),
    "a port out of range": ({**TASK, "ports": [70000]}, "ports[0]"),
    "an array too large": ({**TASK, "array": {"count": 10**9}}, "array.count"),
    "an unknown group vendor": ({**GROUP, "gpu_type": "tpu"}, "gpu_type"),
    "no image for a container": (
        {**{key: value for key, value in TASK.items() if key != "image"}, "runtime": "container"},
        "image",
    ),
    "volumes under the process runtime": (
        {**TASK, "runtime": "process", "volumes": [{"host": "/a", "container": "/b"}]},
        "volumes",
    ),
    "an unknown runtime": ({**TASK, "runtime": "vm"}, "runtime"),
    "a misspelt selector": ({**TASK, "affinity": {"nodes_with_label": {"a": "b"}}}, "affinity.nodes_with_label"),
    "an empty selector": ({**TASK, "affinity": {"nodes_with_labels": {}}}, "affinity.nodes_with_labels"),
    "a label key nodes cannot have": (
        {**TASK, "anti_affinity": {"labels": {"-bad": "x"}}},
        "anti_affinity.labels",
    ),
    "same_service on a task": ({**TASK, "anti_affinity": {"same_service": True}}, "anti_affinity.same_service"),
    "same_service on a group": ({**GROUP, "anti_affinity": {"same_service": True}}, "anti_affinity.same_service"),
    "a group without an image": ({key: value for key, value in GROUP.items() if key != "image"}, "image"),
    "an unknown strategy": ({**GROUP, "strategy": "zero"}, "strategy"),
    "no workers": ({**GROUP, "world_size": 0}, "world_size"),
    "too many workers": ({**GROUP, "world_size": 10**6}, "world_size"),
    "an unknown engine": ({**SERVICE, "engine": "magic"}, "engine"),
    "a service that sleeps too soon": ({**SERVICE, "sleep_after_seconds": 59}, "sleep_after_seconds"),
    "bounds inside the autoscaling": ({**SERVICE, "autoscaling": {"min_replicas": 1}}, "autoscaling"),
    "a probe path without a slash": ({**SERVICE, "health_probe": {"path": "health"}}, "health_probe.path"),
    "an unknown service field": ({**SERVICE, "replicas": 2}, "replicas"),
}


@pytest.mark.parametrize("document, field", REFUSED.values(), ids=REFUSED.keys())
def test_what_the_api_refuses_the_schema_refuses_naming_the_field(api, world, document, field):
    make_model(world.tenants["acme"])
    url, body = payload(document)
    response = api.post(url, body, format="json", **bearer(world.keys["acme-admin"]))
    assert response.status_code == 400, response.json()
    refused = response.json()["error"]["fields"]
    top = field.split(".")[0].split("[")[0]
    assert ("kind" if top == "task_kind" else top) in refused, refused
    assert field in problems(schema_of(api), document)


def test_a_document_of_no_known_kind_is_refused(api, world):
    schema = schema_of(api)
    assert problems(schema, {"name": "x"}) == ["kind"]
    assert problems(schema, {**TASK, "kind": "job"}) == ["kind"]
