"""The heartbeat contract, loaded from the agent package's JSON Schema (the one
description of the payload) and compiled once by jsonschema-rs: a valid 8-GPU payload
costs ~15 µs to check; only a rejected one is walked again to name every field."""

from __future__ import annotations

import ipaddress
import json
from functools import cache
from pathlib import Path

import jsonschema_rs

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "agent" / "heteroflow_agent" / "protocol" / "heartbeat.schema.json"


@cache
def heartbeat_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@cache
def _validator():
    return jsonschema_rs.validator_for(heartbeat_schema())


def _field_name(path) -> str:
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def _pattern_name(path) -> str:
    """A field's name with its list indices left out (`gpu_stats[].fan`): one name per
    field, whatever the number of cards."""
    name = ""
    for part in path:
        name += "[]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def heartbeat_errors(payload) -> dict[str, list[str]]:
    """{} when the payload is valid, else every offending field with its problems. Strict:
    an unknown field is an error (read_heartbeat is the server's tolerant reading)."""
    return _checked(payload, tolerant=False)[0]


def read_heartbeat(payload) -> tuple[dict[str, list[str]], list[str]]:
    """The server's reading of a beat: (errors, ignored). A tolerant reader, so that an
    agent newer than the server (one new field) is not refused on every beat during a
    rolling upgrade: fields the schema does not know are removed from `payload` in place
    and named in `ignored` (list indices written `[]`); the fields it knows are checked
    as strictly as ever. A valid beat costs what it did (one compiled check)."""
    return _checked(payload, tolerant=True)


def _unknown_fields(error) -> list[str] | None:
    unexpected = getattr(error.kind, "unexpected", None)
    if isinstance(error.kind, jsonschema_rs.ValidationErrorKind.AdditionalProperties) and unexpected:
        return list(unexpected)
    return None


def _checked(payload, *, tolerant: bool) -> tuple[dict[str, list[str]], list[str]]:
    validator = _validator()
    ignored: list[str] = []
    if not validator.is_valid(payload):
        errors: dict[str, list[str]] = {}
        unknown: list[tuple[list, str]] = []
        for error in validator.iter_errors(payload):
            names = _unknown_fields(error)
            if names is None:
                errors.setdefault(_field_name(error.instance_path), []).append(error.message)
            else:
                unknown += [(list(error.instance_path), name) for name in names]
        if not tolerant:
            for path, name in unknown:
                errors.setdefault(_field_name([*path, name]), []).append("Unknown field.")
        if errors:
            return errors, []
        if not unknown:
            return {"body": ["Invalid heartbeat."]}, []
        for path, name in unknown:
            _remove(payload, path, name)
        ignored = sorted({_pattern_name([*path, name]) for path, name in unknown})
        if not validator.is_valid(payload):  # what is left must stand on its own
            return _checked(payload, tolerant=False)[0], []
    if "internal_ip" in payload:
        try:
            ipaddress.ip_address(payload["internal_ip"])
        except ValueError:
            return {"internal_ip": ["Not an IP address."]}, []
    indices = [stat["index"] for stat in payload.get("gpu_stats", ())]
    if len(indices) != len(set(indices)):
        return {"gpu_stats": ["Each GPU index may appear once."]}, []
    return {}, ignored


def _remove(payload, path: list, name: str) -> None:
    holder = payload
    for part in path:
        # jsonschema-rs gives an object key that looks like a number ("0" in
        # gpu_capabilities) as an int in the path
        holder = holder[str(part)] if isinstance(holder, dict) and isinstance(part, int) else holder[part]
    holder.pop(name, None)
