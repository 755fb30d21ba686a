"""Key material, for every key that is shown once and kept hashed: tenant and platform
API keys (apps.tenants.keys) and the gateway's endpoint keys (apps.gateway.keys). How a
key is made, hashed and shown in clear is one rule, so that every kind is as strong,
stored the same way, and told apart by the same few characters; the kinds differ only
by their prefix (apps.tenants.choices.KEY_PREFIX, apps.gateway.choices.ENDPOINT_KEY_PREFIX)."""

from __future__ import annotations

import hashlib
import secrets

SECRET_BYTES = 32
DISPLAY_CHARS = 8  # characters after the prefix kept in clear, to tell keys apart


def generate(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(SECRET_BYTES)


def hash_key(key: str) -> str:
    """What is stored of a key, and what a presented key is looked up by."""
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str, prefix: str = "") -> str:
    """What is kept in clear: the key's `prefix` and DISPLAY_CHARS characters more."""
    return key[: len(prefix) + DISPLAY_CHARS]
