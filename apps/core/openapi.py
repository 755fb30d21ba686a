"""The API schema's error answers: every operation documents the error shape
(apps.core.errors.error_body) under the codes any operation can answer, so clients and
the schema fuzzing (tests/core/test_schema_fuzz.py) know every answer the API gives.
drf-spectacular documents only the success answers of a view by itself."""

from __future__ import annotations

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "fields"],
            "properties": {
                "code": {"type": "string", "description": "machine-readable: invalid, not_found, quota_exceeded, …"},
                "message": {"type": "string"},
                "fields": {
                    "type": "object",
                    "description": "for invalid input: each offending field with its problems",
                    "additionalProperties": True,
                },
            },
        }
    },
}

# status → when; what every operation may answer
ERRORS = {
    "400": "Invalid input: the fields and their problems; nothing was written.",
    "401": "No credentials, or credentials that are not valid.",
    "403": "The credentials are valid but may not do this.",
    "404": "No such object among those the caller may see (another tenant's objects are not found).",
    "405": "The method is not allowed here.",
    "406": "The Accept header asks for something other than JSON.",
    "409": "A conflict with the current state: the object changed, a quota, a name already taken.",
    "413": "The body is too large.",
    "415": "The body is not JSON.",
    "429": "Too many requests: retry after the Retry-After header's seconds.",
    "503": "A store the control plane depends on is unavailable; retry.",
}


def add_error_responses(result, generator, request, public):
    """drf-spectacular postprocessing hook: the Error component and ERRORS on every
    operation that does not document that status itself."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    answer = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for methods in result.get("paths", {}).values():
        for method, operation in methods.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            for status, description in ERRORS.items():
                operation["responses"].setdefault(status, {"description": description, **answer})
    return result
