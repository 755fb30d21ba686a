"""Helpers of the image channel's tests (tests/nodes/test_image_*.py): the contract's
validators, an agent's report bodies and CHECK_ITEMs as images-agent sends them."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import jsonschema_rs
from django.apps import apps

from tests.headers import AGENT

SCHEMA = json.loads(
    (
        Path(__file__).resolve().parents[2] / "agent" / "heteroflow_agent" / "protocol" / "image_channel.schema.json"
    ).read_text()
)
DIGEST = "sha256:" + "ab" * 32
SEEDING = importlib.import_module("apps.nodes.migrations.0009_default_watched_images")


def seed_default_watched_images() -> None:
    """The defaults nodes/0009 seeds, again (idempotent): a browser test's flush of the
    database removes what the migrations wrote."""
    SEEDING.seed(apps, None)


def validator(definition: str):
    return jsonschema_rs.validator_for({"$ref": f"#/definitions/{definition}", "definitions": SCHEMA["definitions"]})


def assert_fits(definition: str, value) -> None:
    errors = [f"{list(e.instance_path)}: {e.message}" for e in validator(definition).iter_errors(value)]
    assert not errors, f"{definition}: {errors}"


def item(reference: str, present: bool = True, *, match: str = "exact", tags=None, size: int | None = 1234) -> dict:
    """A CHECK_ITEM."""
    return {
        "reference": reference,
        "present": present,
        "match": match,
        "image_id": DIGEST if present and match == "exact" else None,
        "size_bytes": size if present and match == "exact" else None,
        "tags": tags or [],
    }


def claim(node_id: str) -> dict:
    return {"node_id": node_id, "from_status": "pending", "status": "processing"}


def progress(node_id: str, done: int = 1, total: int = 4, message: str = "pulling") -> dict:
    return {
        "node_id": node_id,
        "from_status": "processing",
        "status": "processing",
        "progress": {
            "layers_done": done,
            "layers_total": total,
            "bytes_done": done * 1000,
            "bytes_total": total * 1000,
            "message": message,
        },
    }


def completed(node_id: str, *items) -> dict:
    return {"node_id": node_id, "from_status": "processing", "status": "completed", "result": {"images": list(items)}}


def failed(node_id: str, error: str = "manifest unknown") -> dict:
    return {"node_id": node_id, "from_status": "processing", "status": "failed", "error": error}


def report(api, request_id: int, body: dict):
    """PUT the body as the agent, after checking it fits the contract (what the agent sends)."""
    assert_fits(
        {"pending": "claim_report"}.get(body["from_status"])
        or ("progress_report" if body["status"] == "processing" else "final_report"),
        body,
    )
    return api.put(f"/api/v1/agent/image-requests/{request_id}", body, format="json", **AGENT)
