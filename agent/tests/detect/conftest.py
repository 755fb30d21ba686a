"""Detection runs for real here: small stand-in executables, written per test, print
recorded vendor outputs (tests/fixtures) from the fixed paths under a scratch root or
from PATH, so find_command, the subprocess call, the timeout and the parsers all run.

PATH is replaced by one scratch directory for every test, so nothing installed on the
machine running the tests (a real nvidia-smi, say) can leak into a result.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from heteroflow_agent.detect import Detector

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SCHEMA_PATH = Path(__file__).resolve().parents[2] / "heteroflow_agent" / "protocol" / "heartbeat.schema.json"

_STAND_IN = """#!{python} -S
import os, sys, time
RULES = {rules!r}
args = sys.argv[1:]
with open({log!r}, "a") as fh:
    fh.write({name!r} + "\\x1f" + "\\x1f".join(args) + "\\n")
def hit(when):
    for need in when:
        if need.endswith("="):
            if not any(a.startswith(need) for a in args):
                return False
        elif need not in args:
            return False
    return True
for rule in RULES:
    if hit(rule["when"]):
        if rule["pid_file"]:
            with open(rule["pid_file"], "w") as fh:
                fh.write(str(os.getpid()))
        if rule["sleep"]:
            time.sleep(rule["sleep"])
        if rule["out"] is not None:
            sys.stdout.buffer.write(open(rule["out"], "rb").read() if rule["file"] else rule["out"].encode())
        if rule["err"]:
            sys.stderr.write(rule["err"])
        sys.stdout.flush()
        sys.exit(rule["code"])
sys.stderr.write("stand-in: no rule for %r\\n" % (args,))
sys.exit(64)
"""


def rule(out=None, *, when=(), code=0, err="", sleep=0.0, text=None, pid_file=None):
    """One answer of a stand-in: when every token in `when` is among its arguments (a
    token ending in "=" matches as a prefix), print fixture `out` (or `text`), write
    `err` to stderr, exit with `code`. Rules are tried in order."""
    if text is not None:
        body, is_file = text, False
    elif out is not None:
        body, is_file = str(FIXTURES / out), True
    else:
        body, is_file = None, False
    return {
        "when": list(when),
        "out": body,
        "file": is_file,
        "code": code,
        "err": err,
        "sleep": sleep,
        "pid_file": str(pid_file) if pid_file else None,
    }


class Host:
    """A scratch machine: a root for the fixed paths, a PATH directory, a call log."""

    def __init__(self, tmp_path: Path):
        self.root = tmp_path / "root"
        self.root.mkdir()
        self.path_dir = tmp_path / "path"
        self.path_dir.mkdir()
        self.log = tmp_path / "calls.log"
        self.log.touch()

    def tool(self, name: str, *rules, at: str | None = "usr/bin") -> Path:
        """Install a stand-in named `name` under root/`at`, or on PATH when `at` is None."""
        directory = self.path_dir if at is None else self.root / at
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        path.write_text(_STAND_IN.format(python=sys.executable, rules=list(rules), log=str(self.log), name=name))
        path.chmod(0o755)
        return path

    def file(self, rel: str, content: str | bytes = "") -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return path

    def calls(self, name: str | None = None) -> list:
        runs = [line.split("\x1f") for line in self.log.read_text().splitlines() if line]
        return [run[1:] for run in runs if name is None or run[0] == name]

    def detector(self, **kwargs) -> Detector:
        kwargs.setdefault("timeout", 5.0)
        kwargs.setdefault("nvml", False)
        kwargs.setdefault("is_container", False)
        return Detector(str(self.root), **kwargs)


@pytest.fixture
def host(tmp_path, monkeypatch) -> Host:
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    return Host(tmp_path)


def fixture_text(rel: str) -> str:
    return (FIXTURES / rel).read_text(encoding="utf-8", errors="replace")


# -- a small JSON Schema checker for the heartbeat contract (stdlib only) ----------


class SchemaError(AssertionError):
    pass


def _check(value, schema: dict, root: dict, where: str) -> None:
    if "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/"), ref
        target = root
        for part in ref[2:].split("/"):
            target = target[part]
        _check(value, target, root, where)
        return
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind in types and not isinstance(value, types[kind]):
        raise SchemaError(f"{where}: {value!r} is not {kind}")
    if kind == "integer" and (isinstance(value, bool) or not isinstance(value, int)):
        raise SchemaError(f"{where}: {value!r} is not an integer")
    if kind == "number" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise SchemaError(f"{where}: {value!r} is not a number")
    if "enum" in schema and value not in schema["enum"]:
        raise SchemaError(f"{where}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        raise SchemaError(f"{where}: {value!r} < {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        raise SchemaError(f"{where}: {value!r} > {schema['maximum']}")
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise SchemaError(f"{where}: longer than {schema['maxLength']}")
        if "minLength" in schema and len(value) < schema["minLength"]:
            raise SchemaError(f"{where}: shorter than {schema['minLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise SchemaError(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise SchemaError(f"{where}: more than {schema['maxItems']} items")
        if schema.get("uniqueItems") and len({json.dumps(v, sort_keys=True) for v in value}) != len(value):
            raise SchemaError(f"{where}: items not unique")
        for i, item in enumerate(value):
            if "items" in schema:
                _check(item, schema["items"], root, f"{where}[{i}]")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise SchemaError(f"{where}: missing {key}")
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            raise SchemaError(f"{where}: more than {schema['maxProperties']} properties")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if "propertyNames" in schema:
                _check(key, dict(schema["propertyNames"], type="string"), root, f"{where} key {key!r}")
            if key in props:
                _check(item, props[key], root, f"{where}.{key}")
            elif extra is False:
                raise SchemaError(f"{where}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                _check(item, extra, root, f"{where}.{key}")


@pytest.fixture(scope="session")
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@pytest.fixture
def validate(schema):
    """validate(fields): check heartbeat keys against the schema's own definitions."""

    def check(fields: dict) -> None:
        for key, value in fields.items():
            assert key in schema["properties"], f"{key} is not a heartbeat field"
            _check(value, schema["properties"][key], schema, key)

    return check


@pytest.fixture
def check_schema(schema):
    """check_schema(value, subschema): the raw checker, for tests of the checker."""

    def check(value, subschema):
        _check(value, subschema, schema, "value")

    return check
