"""The error codes every part of the API shares: DRF's own (the thin ASGI routes answer
with them too) and the conflicts several apps raise. An app's own codes are in its
`error_codes.py`; docs/api.md says what each means (tests/core/test_error_codes.py).

The enums are StrEnums, so a member is its value wherever it goes: JSON, a metric's
label, `str()` (a plain `(str, Enum)` prints its class name there)."""

from __future__ import annotations

from enum import StrEnum


class CoreErrorCode(StrEnum):
    INVALID = "invalid"
    UNKNOWN_FIELD = "unknown_field"  # a field's own code, under `fields`; the answer's is `invalid`
    REQUIRED = "required"  # a field's own code, as DRF gives a missing field's; the answer's is `invalid`
    PARSE_ERROR = "parse_error"
    BAD_REQUEST = "bad_request"
    NOT_AUTHENTICATED = "not_authenticated"
    AUTHENTICATION_FAILED = "authentication_failed"
    PERMISSION_DENIED = "permission_denied"
    HTTPS_REQUIRED = "https_required"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    CONFLICT = "conflict"
    STATUS_CHANGED = "status_changed"
    INVALID_STATE = "invalid_state"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    THROTTLED = "throttled"
    UNAVAILABLE = "unavailable"
    SERVER_ERROR = "server_error"
    ERROR = "error"  # an error that carries no code of its own
