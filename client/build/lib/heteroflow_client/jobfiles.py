"""Job files: one YAML format for tasks, task groups and inference services.

    kind: task            # task | group | service
    name: hello
    image: busybox
    command: [echo, hello]

`kind` names what the document creates; the other keys are the body of that create
(POST /api/v1/tasks, /api/v1/task-groups, /api/v1/inference-services), except the
task's own kind (job, training, inference), written `task_kind`. A file may hold several
documents separated by `---`.

The format is a JSON Schema (draft 2020-12) that the server publishes at
GET /api/v1/schemas/jobs; it is cached per server under ~/.cache/heteroflow/ and asked
again with If-None-Match, so a server that changed its limits is followed at once. Every
document of a file is checked before anything is sent; a problem is reported as
`file:line:column: field: message` from the YAML parser's marks. One problem anywhere in
the file (a YAML syntax error included) and nothing is submitted.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from heteroflow_client.config import cache_dir
from heteroflow_client.errors import HeteroFlowError, ValidationError
from heteroflow_client.transport import Transport

SCHEMA_PATH = "/api/v1/schemas/jobs"
KINDS = ("task", "group", "service")
ENDPOINTS = {"task": "tasks", "group": "task-groups", "service": "inference-services"}
# a job file's name for a payload field the document's own `kind` would hide
RENAMED = {"task": {"task_kind": "kind"}}


@dataclass
class Document:
    """One document of a job file: its data, where it starts, and its YAML node (for
    the marks of its fields)."""

    file: str
    index: int
    data: Any
    node: Any = field(repr=False, default=None)

    @property
    def kind(self) -> str | None:
        return self.data.get("kind") if isinstance(self.data, dict) else None

    def payload(self) -> dict:
        """The create body: the document without `kind`, renamed fields back."""
        renamed = RENAMED.get(self.kind or "", {})
        return {renamed.get(key, key): value for key, value in self.data.items() if key != "kind"}

    @property
    def endpoint(self) -> str:
        if self.kind == "task" and "array" in self.data:
            return "tasks/batch"
        return ENDPOINTS[self.kind or ""]


def parse(text: str, file: str) -> list[Document]:
    """The documents of a YAML text; a syntax error is a ValidationError at its mark."""
    loader = yaml.SafeLoader(text)
    documents = []
    try:
        while loader.check_node():
            node = loader.get_node()
            data = loader.construct_document(node)
            if data is None:  # an empty document (a trailing ---)
                continue
            documents.append(Document(file, len(documents), data, node))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = exc.problem or str(exc)
        if exc.context:
            started = exc.context_mark
            where = ""
            if started is not None and (mark is None or started.line != mark.line or started.column != mark.column):
                where = f" started at line {started.line + 1}, column {started.column + 1}"
            message = f"{message} ({exc.context}{where})"
        raise ValidationError(
            file, mark.line + 1 if mark else None, mark.column + 1 if mark else None, None, message
        ) from None
    except yaml.YAMLError as exc:
        raise ValidationError(file, None, None, None, str(exc)) from None
    finally:
        loader.dispose()
    return documents


def load(path: str) -> list[Document]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise HeteroFlowError(f"cannot read {path}: {exc.strerror or exc}") from None
    return parse(text, path)


# --- where a field is ------------------------------------------------------------------------


def node_at(node: Any, path: list) -> tuple[Any, Any]:
    """The value node at `path` (keys and indices) and the key node naming it (None for
    a list item or the document)."""
    key_node = None
    for step in path:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value == str(step):
                    key_node, node = k, v
                    break
            else:
                return node, key_node
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
            key_node, node = None, node.value[step]
        else:
            return node, key_node
    return node, key_node


def field_name(path: list) -> str:
    """volumes[0].host, as the API names fields."""
    name = ""
    for step in path:
        name += f"[{step}]" if isinstance(step, int) else (f".{step}" if name else str(step))
    return name


def _mark(node: Any) -> tuple[int | None, int | None]:
    if node is None:
        return None, None
    return node.start_mark.line + 1, node.start_mark.column + 1


# --- the schema --------------------------------------------------------------------------------


def cache_file(url: str) -> Path:
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]
    return cache_dir() / "schemas" / f"jobs-{digest}.json"


def fetch_schema(transport: Transport) -> dict:
    """The server's job schema, from the cache when the server's ETag says it is current."""
    path = cache_file(transport.url)
    cached = None
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    headers = {}
    if cached and cached.get("etag"):
        headers["If-None-Match"] = cached["etag"]
    response = transport.send("GET", SCHEMA_PATH, headers=headers, ok=(304,))
    if response.status_code == 304 and cached:
        return cached["schema"]
    schema = response.json()
    etag = response.headers.get("ETag")
    if etag:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps({"url": transport.url, "etag": etag, "schema": schema}))
            os.replace(temporary, path)
        except OSError:
            pass  # a cache that cannot be written only costs a download next time
    return schema


# --- checking ----------------------------------------------------------------------------------


def _describe(error) -> str:
    """A jsonschema error in words, with a hint for YAML's usual surprises."""
    schema = error.schema if isinstance(error.schema, dict) else {}
    if schema.get("errorMessage"):  # the server's words for a rule (an annotation keyword)
        return str(schema["errorMessage"])
    if error.validator == "type":
        expected = error.validator_value
        wanted = expected if isinstance(expected, list) else [expected]
        message = f"{_short(error.instance)} is not of type {' or '.join(map(str, wanted))}"
        if "string" in wanted and isinstance(error.instance, (int, float, bool)):
            message += " (quote it in YAML: '...')"
        return message
    if error.validator == "enum":
        return f"{_short(error.instance)} is not one of {', '.join(map(str, error.validator_value))}"
    if error.validator == "const":
        return f"must be {error.validator_value!r}"
    return error.message


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def check(documents: list[Document], schema: dict) -> list[ValidationError]:
    """Every problem of every document, in file order."""
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(schema)
    problems: list[tuple[tuple, ValidationError]] = []
    for document in documents:
        if not isinstance(document.data, dict):
            line, column = _mark(document.node)
            problems.append(
                (
                    (line or 0, column or 0),
                    ValidationError(
                        document.file,
                        line,
                        column,
                        None,
                        f"a document is a mapping with `kind` ({', '.join(KINDS)}), not {type(document.data).__name__}",
                    ),
                )
            )
            continue
        for error in validator.iter_errors(document.data):
            for path, message, at_key in _explain(error):
                value_node, key_node = node_at(document.node, path)
                line, column = _mark(key_node if at_key and key_node is not None else value_node)
                name = field_name(path) or None
                problems.append(((line or 0, column or 0), ValidationError(document.file, line, column, name, message)))
    problems.sort(key=lambda item: item[0])
    seen, unique = set(), []
    for _, problem in problems:
        key = problem.location_text()
        if key not in seen:
            seen.add(key)
            unique.append(problem)
    return unique


def _explain(error) -> list[tuple[list, str, bool]]:
    """(path, message, at the key?) for one jsonschema error: an unknown field is named
    at its own key, a missing one at its object, anything else at its value."""
    path = list(error.absolute_path)
    if "propertyNames" in error.relative_schema_path:
        return [(path + [error.instance], f"{error.instance!r}: {_describe(error)}", True)]
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = set((error.schema or {}).get("properties", {}))
        unknown = [key for key in error.instance if key not in known]
        return [(path + [key], "unknown field", True) for key in unknown] or [(path, error.message, False)]
    if error.validator == "required":
        missing = [name for name in error.validator_value if name not in (error.instance or {})]
        return [(path + [name], "required field missing", False) for name in missing]
    if error.validator in ("if", "allOf") and error.context:
        return [item for sub in error.context for item in _explain(sub)]
    if error.validator in ("anyOf", "oneOf") and error.context and not (error.schema or {}).get("errorMessage"):
        from jsonschema.exceptions import best_match

        best = best_match(error.context)
        return _explain(best) if best is not None else [(path, error.message, False)]
    return [(path, _describe(error), False)]


def validated(documents: list[Document], transport: Transport) -> list[Document]:
    """The documents, once every one passes the server's schema; else the ValidationError
    listing every problem (nothing is sent)."""
    if not documents:
        return documents
    problems = check(documents, fetch_schema(transport))
    if problems:
        first = problems[0]
        raise ValidationError(first.file, first.line, first.column, first.field, first.problem, errors=problems)
    return documents
