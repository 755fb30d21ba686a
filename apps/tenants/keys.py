"""API keys: their scopes' prefixes, lookup, use (the material: apps.core.key_material). Keys
are shown once and stored hashed."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Q

from apps.core import key_material
from apps.core.db import column_count, model_from_row, select_list
from apps.tenants.choices import KEY_PREFIX, KeyScope
from apps.tenants.models import ApiKey, Tenant

hash_key = key_material.hash_key


def generate(scope: KeyScope) -> str:
    return key_material.generate(KEY_PREFIX[scope])


def display_prefix(key: str) -> str:
    scope = scope_of(key)
    return key_material.display_prefix(key, KEY_PREFIX[scope] if scope else "")


def scope_of(key: str) -> KeyScope | None:
    for scope, prefix in KEY_PREFIX.items():
        if key.startswith(prefix):
            return scope
    return None


def find_usable(key: str, *, now: datetime):
    if scope_of(key) is None:
        return None
    api_key = _key_with_user_and_tenant(hash_key(key))
    if api_key is None or not api_key.is_usable_at(now):
        return None
    return api_key


def _key_with_user_and_tenant(key_hash: str):
    """ApiKey.objects.select_related("user", "tenant").filter(key_hash=…).first(), read
    in one prepared statement: every API request with a key runs it."""
    user_model, user, tenant = ApiKey._meta.get_field("user").related_model, "u", "t"
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {select_list(ApiKey, 'k')}, {select_list(user_model, user)}, {select_list(Tenant, tenant)} "
            f"FROM {ApiKey._meta.db_table} k "
            f"JOIN {user_model._meta.db_table} {user} ON {user}.{user_model._meta.pk.column} = k.user_id "
            f"LEFT JOIN {Tenant._meta.db_table} {tenant} ON {tenant}.{Tenant._meta.pk.column} = k.tenant_id "
            "WHERE k.key_hash = %s",
            [key_hash],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    keys, users = column_count(ApiKey), column_count(user_model)
    api_key = model_from_row(ApiKey, row[:keys], "k")
    api_key.user = model_from_row(user_model, row[keys : keys + users], user)
    api_key.tenant = model_from_row(Tenant, row[keys + users :], tenant) if api_key.tenant_id is not None else None
    return api_key


def touch(api_key, *, now: datetime, resolution: timedelta) -> None:
    """Record use, at most once per `resolution`, so a busy key does not write per request."""
    if api_key.last_used_at and now - api_key.last_used_at < resolution:
        return
    ApiKey.objects.filter(pk=api_key.pk).filter(
        Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - resolution)
    ).update(last_used_at=now)
