"""The typed environment readers (heteroflow.envvars): a bad value fails at start-up,
naming the variable and what it takes."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from heteroflow.envvars import Env


def test_a_mapping_is_key_value_pairs_and_anything_else_is_named():
    env = Env({"IMAGES": " nvidia=registry.local/nb:cuda@sha256:ab , default=quay.io/jupyter/base-notebook,"})
    assert env.mapping("IMAGES", {}) == {
        "nvidia": "registry.local/nb:cuda@sha256:ab",
        "default": "quay.io/jupyter/base-notebook",
    }
    assert Env({}).mapping("IMAGES", {"default": "x"}) == {"default": "x"}
    for bad in ("nvidia", "=image", "nvidia="):
        with pytest.raises(ImproperlyConfigured, match=f"IMAGES={bad!r}: {bad!r} is not key=value"):
            Env({"IMAGES": bad}).mapping("IMAGES", {})
