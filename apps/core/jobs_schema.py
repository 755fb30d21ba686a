"""The job file's JSON Schema (draft 2020-12), served at GET /api/v1/schemas/jobs for `hf`
and the SDK (client/, docs/cli.md#job-files), which check every document against it
before they send anything.

A job file holds one or more YAML documents, each with `kind: task | group | service`
naming what it creates; the other keys are the body of that create (POST
/api/v1/tasks, /api/v1/task-groups, /api/v1/inference-services), with one rename: a
task's own `kind` (job, training, inference) is written `task_kind`, since `kind` names
the document. A group's own `kind` is left out (only `training` groups can be submitted).
A task with `array: {count: N}` is an array (POST /api/v1/tasks/batch).

The schema is made from the serializers that validate those bodies, passed in by the
view (this module is plumbing and imports no app): every field with its type, its
choices (the apps' TextChoices), its bounds (MAX_GPUS_PER_TASK, the priorities…), its
length limits, whether it is required or may be null, nested objects as strict as their
serializers (`additionalProperties: false`, as StrictSerializer refuses unknown fields).
The rules a serializer writes in Python are added below by name (RULES), with their
bounds read from the settings the serializers read; tests/core/test_jobs_schema.py holds
the schema to the API: what one accepts the other accepts, what one refuses the other
refuses.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from rest_framework import serializers
from rest_framework.fields import empty

DIALECT = "https://json-schema.org/draft/2020-12/schema"
KINDS = ("task", "group", "service")
# the job file's name for a body field that the document's own `kind` would hide
RENAMED = {"task": {"kind": "task_kind"}}
# body fields a kind's documents leave out
LEFT_OUT = {"group": ("kind",)}
# apps.inference.sleep.validate_sleep_policy: a service sleeps after at least a minute
MIN_SLEEP_AFTER_SECONDS = 60


@dataclass(frozen=True)
class Sources:
    """What the schema is made from: the create serializers of each kind, and the pattern
    of an environment variable's name (apps.tasks.api.serializers.ENV_NAME)."""

    task: type[serializers.Serializer]
    group: type[serializers.Serializer]
    service: type[serializers.Serializer]
    env_name: str


def field_schema(field: serializers.Field) -> dict[str, Any]:
    """One DRF field as JSON Schema."""
    schema: dict[str, Any]
    if isinstance(field, serializers.ListSerializer):
        schema = {"type": "array", "items": field_schema(field.child)}
        if field.max_length is not None:
            schema["maxItems"] = field.max_length
        if field.min_length is not None:
            schema["minItems"] = field.min_length
    elif isinstance(field, serializers.Serializer):
        schema = object_schema(field)
    elif isinstance(field, serializers.ChoiceField):
        schema = {"enum": [str(choice) for choice in field.choices]}
    elif isinstance(field, serializers.BooleanField):
        schema = {"type": "boolean"}
    elif isinstance(field, serializers.IntegerField):
        schema = {"type": "integer"}
        _bounds(schema, field)
    elif isinstance(field, (serializers.FloatField, serializers.DecimalField)):
        schema = {"type": "number"}
        _bounds(schema, field)
    elif isinstance(field, serializers.DateTimeField):
        schema = {"type": "string", "format": "date-time"}
    elif isinstance(field, serializers.CharField):
        schema = {"type": "string"}
        if isinstance(field, serializers.RegexField):
            schema["pattern"] = next(v.regex.pattern for v in field.validators if hasattr(v, "regex"))
        if field.max_length is not None:
            schema["maxLength"] = field.max_length
        if not field.allow_blank:
            # DRF trims the value first; a blank one is refused
            schema["minLength"] = max(field.min_length or 0, 1)
            schema["pattern"] = schema.get("pattern", r"\S")
        elif field.min_length is not None:
            schema["minLength"] = field.min_length
    elif isinstance(field, serializers.ListField):
        schema = {"type": "array", "items": field_schema(field.child)}
        if field.max_length is not None:
            schema["maxItems"] = field.max_length
        if field.min_length is not None:
            schema["minItems"] = field.min_length
    elif isinstance(field, serializers.DictField):
        schema = {"type": "object", "additionalProperties": field_schema(field.child)}
        # a field that names its keys' spelling and bounds (the node label selectors)
        if getattr(field, "key_pattern", None):
            schema["propertyNames"] = {"pattern": field.key_pattern}
        if getattr(field, "max_keys", None):
            schema["maxProperties"] = field.max_keys
        if not field.allow_empty:
            schema["minProperties"] = 1
    else:  # JSONField and anything else: any JSON value
        schema = {}
    if getattr(field, "allow_null", False):
        schema = _nullable(schema)
    if field.help_text:
        schema["description"] = str(field.help_text)
    if field.default is not empty and not callable(field.default):
        schema["default"] = field.default
    return schema


def _bounds(schema: dict, field) -> None:
    if field.min_value is not None:
        schema["minimum"] = field.min_value
    if field.max_value is not None:
        schema["maximum"] = field.max_value


def _nullable(schema: dict) -> dict:
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    if isinstance(schema.get("type"), str):
        return {**schema, "type": [schema["type"], "null"]}
    if not schema:
        return schema
    return {"anyOf": [schema, {"type": "null"}]}


def object_schema(serializer: serializers.Serializer) -> dict[str, Any]:
    """A strict serializer as an object: its writable fields, the required ones, no
    other field."""
    writable = {name: field for name, field in serializer.fields.items() if not field.read_only}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {name: field_schema(field) for name, field in writable.items()},
        "additionalProperties": False,
    }
    required = [name for name, field in writable.items() if field.required]
    if required:
        schema["required"] = required
    return schema


def env_schema(env_name: str) -> dict[str, Any]:
    """A task's `env` (TaskCreateSerializer.validate_env): names as variable names,
    values strings or references to the tenant's secrets."""
    return {
        "type": "object",
        "propertyNames": {"pattern": env_name, "errorMessage": "not a valid environment variable name"},
        "additionalProperties": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "object",
                    "properties": {"secret": {"type": "string", "minLength": 1}},
                    "required": ["secret"],
                    "additionalProperties": False,
                },
            ],
            "errorMessage": 'values are strings or secret references: {"secret": "<name of a secret>"}',
        },
    }


def only_for_inference(what: str) -> dict[str, Any]:
    return {"not": {}, "errorMessage": f"only inference tasks (task_kind: inference) have {what}"}


# apps.tasks.api.serializers.image_problems and constraints_problems (what JSON Schema can
# say of them: a label both asked for and avoided is the server's to refuse)
PROCESS_RUNTIME = "process"
RUNTIME_RULES = [
    {
        "if": {"not": {"properties": {"runtime": {"const": PROCESS_RUNTIME}}, "required": ["runtime"]}},
        "then": {"required": ["image"], "properties": {"image": {"minLength": 1, "pattern": r"\S"}}},
    },
    {
        "if": {"properties": {"runtime": {"const": PROCESS_RUNTIME}}, "required": ["runtime"]},
        "then": {
            "properties": {
                "volumes": {
                    "maxItems": 0,
                    "errorMessage": "the process runtime cannot mount volumes (no container to mount them in)",
                }
            }
        },
    },
]
NOT_A_SERVICE = {
    "const": False,
    "errorMessage": "only an inference service's replicas have a service to keep apart from",
}


def constraint_rules(schema: dict) -> None:
    """The runtime's image and volume rules, and no same_service outside a service."""
    schema.setdefault("allOf", []).extend(copy.deepcopy(RUNTIME_RULES))
    schema["required"] = [name for name in schema.get("required", []) if name != "image"]
    schema["properties"]["anti_affinity"]["properties"]["same_service"] |= NOT_A_SERVICE


def task_rules(schema: dict) -> None:
    """TaskCreateSerializer.validate and ArraySerializer.validate_count."""
    properties = schema["properties"]
    properties["array"]["properties"]["count"]["maximum"] = settings.HETEROFLOW_TASK_BATCH_MAX
    schema["required"] = [name for name in schema.get("required", []) if name != "array"]
    constraint_rules(schema)
    schema["allOf"] += [
        {
            "if": {"properties": {"task_kind": {"const": "training"}}, "required": ["task_kind"]},
            "then": {
                "properties": {"preemptible": {"const": False, "errorMessage": "training tasks cannot be preemptible"}}
            },
        },
        {
            "if": {"not": {"properties": {"task_kind": {"const": "inference"}}, "required": ["task_kind"]}},
            "then": {
                "properties": {
                    "health_probe": {"type": "null", "errorMessage": "only inference tasks have a health probe"},
                    "serving": only_for_inference("a serving spec"),
                }
            },
        },
    ]


def group_rules(schema: dict) -> None:
    """TaskGroupCreateSerializer.validate_world_size and validate."""
    schema["properties"]["world_size"]["maximum"] = settings.HETEROFLOW_GROUP_MAX_WORLD_SIZE
    constraint_rules(schema)


def service_rules(schema: dict) -> None:
    """ServiceCreateSerializer's validate_* methods, what JSON Schema can say of them
    (max_replicas not below min_replicas, a model's engines and the window's and
    autoscaling's inner rules are checked by the server)."""
    properties = schema["properties"]
    for name in ("min_replicas", "max_replicas"):
        properties[name]["maximum"] = settings.HETEROFLOW_GROUP_MAX_WORLD_SIZE
    sleep = properties["sleep_after_seconds"]
    sleep["minimum"] = MIN_SLEEP_AFTER_SECONDS
    properties["health_probe"]["properties"]["path"]["pattern"] = "^/"
    properties["autoscaling"]["allOf"] = [
        {
            "not": {"anyOf": [{"required": ["min_replicas"]}, {"required": ["max_replicas"]}]},
            "errorMessage": "min_replicas and max_replicas are fields of the service, not of its autoscaling policy",
        }
    ]


RULES = {"task": task_rules, "group": group_rules, "service": service_rules}


def kind_schema(kind: str, serializer_class: type[serializers.Serializer], env_name: str) -> dict[str, Any]:
    body = object_schema(serializer_class())
    properties = body["properties"]
    for name in LEFT_OUT.get(kind, ()):
        properties.pop(name, None)
    for name, new in RENAMED.get(kind, {}).items():
        properties[new] = properties.pop(name)
    if "env" in properties:
        properties["env"] = {
            **env_schema(env_name),
            **{k: v for k, v in properties["env"].items() if k == "description"},
        }
    body["required"] = ["kind", *(RENAMED.get(kind, {}).get(name, name) for name in body.get("required", []))]
    body["properties"] = {"kind": {"const": kind}, **properties}
    RULES[kind](body)
    return body


def build(sources: Sources) -> dict[str, Any]:
    """The whole schema: one document of a job file."""
    definitions = {
        "task": kind_schema("task", sources.task, sources.env_name),
        "group": kind_schema("group", sources.group, sources.env_name),
        "service": kind_schema("service", sources.service, sources.env_name),
    }
    return {
        "$schema": DIALECT,
        "title": "HeteroFlow job file document",
        "description": "One YAML document of a job file: `kind` names what it creates (task, group, service); "
        "the other keys are the body of that create (docs/api.md), a task's own kind written `task_kind`.",
        "type": "object",
        "required": ["kind"],
        "properties": {"kind": {"enum": list(KINDS), "description": "what the document creates"}},
        "allOf": [
            {
                "if": {"properties": {"kind": {"const": kind}}, "required": ["kind"]},
                "then": {"$ref": f"#/$defs/{kind}"},
            }
            for kind in KINDS
        ],
        "$defs": definitions,
    }


@dataclass(frozen=True)
class Published:
    schema: dict
    body: bytes  # the JSON as served
    etag: str


_published: dict[tuple, Published] = {}


def published(sources: Sources) -> Published:
    """The schema, its JSON and its ETag, built once per set of the settings it reads."""
    key = (sources, settings.HETEROFLOW_TASK_BATCH_MAX, settings.HETEROFLOW_GROUP_MAX_WORLD_SIZE)
    found = _published.get(key)
    if found is None:
        schema = build(sources)
        body = json.dumps(schema, sort_keys=True, separators=(",", ":")).encode()
        found = Published(schema, body, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
        _published[key] = found
    return Published(copy.deepcopy(found.schema), found.body, found.etag)
