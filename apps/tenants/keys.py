"""API key material: generation, hashing, lookup. Keys are shown once and stored hashed."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

from django.db.models import Q

from apps.tenants.choices import KEY_PREFIX, KeyScope
from apps.tenants.models import ApiKey

SECRET_BYTES = 32
DISPLAY_CHARS = 8  # characters after the prefix kept in clear, to tell keys apart


def generate(scope: KeyScope) -> str:
    return KEY_PREFIX[scope] + secrets.token_urlsafe(SECRET_BYTES)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    scope = scope_of(key)
    return key[: len(KEY_PREFIX[scope]) + DISPLAY_CHARS] if scope else key[:DISPLAY_CHARS]


def scope_of(key: str) -> KeyScope | None:
    for scope, prefix in KEY_PREFIX.items():
        if key.startswith(prefix):
            return scope
    return None


def find_usable(key: str, *, now: datetime):
    if scope_of(key) is None:
        return None
    api_key = ApiKey.objects.select_related("user", "tenant").filter(key_hash=hash_key(key)).first()
    if api_key is None or not api_key.is_usable_at(now):
        return None
    return api_key


def touch(api_key, *, now: datetime, resolution: timedelta) -> None:
    """Record use, at most once per `resolution`, so a busy key does not write per request."""
    if api_key.last_used_at and now - api_key.last_used_at < resolution:
        return
    ApiKey.objects.filter(pk=api_key.pk).filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - resolution)
    ).update(last_used_at=now)
