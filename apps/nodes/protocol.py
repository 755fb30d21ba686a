"""The heartbeat contract, loaded from the agent package's JSON Schema (the one
description of the payload). Valid payloads pay for one compiled check; only a rejected
payload is walked again to name every offending field."""

from __future__ import annotations

import ipaddress
import json
from functools import cache
from pathlib import Path

import fastjsonschema
import jsonschema

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "agent" / "heteroflow_agent" / "protocol" / "heartbeat.schema.json"


@cache
def heartbeat_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@cache
def _compiled():
    return fastjsonschema.compile(heartbeat_schema())


def _field_name(path) -> str:
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def heartbeat_errors(payload) -> dict[str, list[str]]:
    """{} when the payload is valid, else every offending field with its problems."""
    try:
        _compiled()(payload)
    except fastjsonschema.JsonSchemaValueException:
        errors: dict[str, list[str]] = {}
        for error in jsonschema.Draft7Validator(heartbeat_schema()).iter_errors(payload):
            if error.validator == "additionalProperties":
                known = set(error.schema.get("properties", {}))
                for name in sorted(set(error.instance) - known):
                    errors.setdefault(_field_name([*error.absolute_path, name]), []).append("Unknown field.")
                continue
            errors.setdefault(_field_name(error.absolute_path), []).append(error.message)
        return errors or {"body": ["Invalid heartbeat."]}
    if "internal_ip" in payload:
        try:
            ipaddress.ip_address(payload["internal_ip"])
        except ValueError:
            return {"internal_ip": ["Not an IP address."]}
    indices = [stat["index"] for stat in payload.get("gpu_stats", ())]
    if len(indices) != len(set(indices)):
        return {"gpu_stats": ["Each GPU index may appear once."]}
    return {}
