"""Endpoint key material: generation, hashing, what is kept in clear. Shown once, stored hashed."""

from __future__ import annotations

import hashlib
import secrets

from apps.gateway.choices import ENDPOINT_KEY_PREFIX

SECRET_BYTES = 32
DISPLAY_CHARS = 8  # characters after the prefix kept in clear, to tell keys apart


def generate() -> str:
    return ENDPOINT_KEY_PREFIX + secrets.token_urlsafe(SECRET_BYTES)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    return key[: len(ENDPOINT_KEY_PREFIX) + DISPLAY_CHARS]


def is_endpoint_key(token: str) -> bool:
    return token.startswith(ENDPOINT_KEY_PREFIX)
