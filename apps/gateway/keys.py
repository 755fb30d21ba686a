"""Endpoint keys: the material of every shown-once key (apps.core.key_material) under the
endpoint key's prefix. Shown once, stored hashed."""

from __future__ import annotations

from apps.core import key_material
from apps.gateway.choices import ENDPOINT_KEY_PREFIX

hash_key = key_material.hash_key


def generate() -> str:
    return key_material.generate(ENDPOINT_KEY_PREFIX)


def display_prefix(key: str) -> str:
    return key_material.display_prefix(key, ENDPOINT_KEY_PREFIX)


def is_endpoint_key(token: str) -> bool:
    return token.startswith(ENDPOINT_KEY_PREFIX)
