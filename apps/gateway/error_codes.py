"""The codes of the OpenAI-compatible endpoints' errors (`/v1/*`, in OpenAI's shape:
docs/gateway.md, Errors). They are the gateway's own vocabulary, so the few words it
shares with the management API (`method_not_allowed`…) are listed here again."""

from __future__ import annotations

from enum import StrEnum


class GatewayErrorCode(StrEnum):
    HTTPS_REQUIRED = "https_required"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_NOT_ALLOWED = "model_not_allowed"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    LIMITS_UNAVAILABLE = "limits_unavailable"
    CATALOG_UNAVAILABLE = "catalog_unavailable"
    NO_HEALTHY_BACKEND = "no_healthy_backend"
    MODEL_WAKING = "model_waking"
    BACKEND_UNREACHABLE = "backend_unreachable"
    BACKEND_ERROR = "backend_error"
    BACKEND_TIMEOUT = "backend_timeout"
    SERVER_ERROR = "server_error"
