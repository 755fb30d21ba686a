"""The inference app's error codes (docs/api.md, Errors)."""

from __future__ import annotations

from enum import StrEnum


class InferenceErrorCode(StrEnum):
    MODEL_EXISTS = "model_exists"
    MODEL_IN_USE = "model_in_use"
    NODE_HAS_MODELS = "node_has_models"
    FROZEN = "frozen"  # a field's own code, under `fields`; the answer's is `invalid`
