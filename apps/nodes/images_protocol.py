"""The image channel's contract, loaded from the agent package's JSON Schema
(agent/heteroflow_agent/protocol/image_channel.schema.json, the one description of the
shapes; docs/images.md): the reference grammar, and the checks of the parts of an agent's
report (its progress and its result) against the schema's definitions. Compiled once by
jsonschema-rs, as the heartbeat's contract is (apps.nodes.protocol)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import jsonschema_rs

SCHEMA_PATH = (
    Path(__file__).resolve().parents[2] / "agent" / "heteroflow_agent" / "protocol" / "image_channel.schema.json"
)
NAME_MAX = 255  # the docker reference grammar's limit on the name (domain and path, no tag or digest)


@cache
def image_channel_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@cache
def _validator(definition: str):
    schema = image_channel_schema()
    return jsonschema_rs.validator_for({"$ref": f"#/definitions/{definition}", "definitions": schema["definitions"]})


@cache
def _reference_pattern() -> re.Pattern:
    return re.compile(image_channel_schema()["definitions"]["reference"]["pattern"])


def definition_errors(definition: str, value, field: str) -> dict[str, list[str]]:
    """{} when `value` fits the schema's `definition`, else each offending path under
    `field` (`result.images[0].present`) with its problems."""
    validator = _validator(definition)
    if validator.is_valid(value):
        return {}
    errors: dict[str, list[str]] = {}
    for error in validator.iter_errors(value):
        name = field
        for part in error.instance_path:
            name += f"[{part}]" if isinstance(part, int) else f".{part}"
        errors.setdefault(name, []).append(error.message)
    return errors


def is_valid(definition: str, value) -> bool:
    return _validator(definition).is_valid(value)


def reference_error(reference) -> str | None:
    """None for a reference in the docker reference grammar
    ([domain[:port]/]path[:tag][@digest]), else why not."""
    if not isinstance(reference, str) or not reference:
        return "An image reference is a non-empty string."
    if not _reference_pattern().match(reference):
        return (
            f"'{reference[:200]}' is not an image reference ([registry[:port]/]repository[:tag][@digest], "
            "the repository in lower case)."
        )
    if len(image_name(reference)) > NAME_MAX:
        return f"An image's name (registry and repository) is at most {NAME_MAX} characters."
    return None


def image_name(reference: str) -> str:
    """The reference without its tag and digest: the repository (with its registry)."""
    name = reference.split("@", 1)[0]
    head, slash, last = name.rpartition("/")
    return head + slash + last.split(":", 1)[0]


def is_bare(reference: str) -> bool:
    """A bare repository: no tag and no digest (a check answers it with every local tag;
    a pull fetches :latest)."""
    return image_name(reference) == reference


def answers(asked: str, reported: str) -> bool:
    """Whether a result item's reference answers the asked one: the same, or (an agent
    older than this channel's repository match) a bare repository answered as :latest."""
    return reported == asked or (is_bare(asked) and reported == f"{asked}:latest")
