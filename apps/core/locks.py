"""PostgreSQL advisory locks: the cross-instance critical sections.

Keys are strings ("job:scheduler.tick", "tenant:42"); they map to one 64-bit lock id by
a stable hash so every process and every instance agrees on the id.
"""

from __future__ import annotations

import hashlib

from django.db import connection


def lock_id(key: str) -> int:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def try_xact_lock(key: str) -> bool:
    """Take the lock for the current transaction if nobody holds it; never waits."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [lock_id(key)])
        return bool(cursor.fetchone()[0])


def try_xact_lock_named(key: str, application_name: str) -> bool:
    """`try_xact_lock`, and the session's application_name for the transaction when the
    lock is taken (one round trip): pg_stat_activity, lock waits and the server log then
    say whose transaction holds what (`job:nodes.check_health`)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CASE WHEN pg_try_advisory_xact_lock(%s) THEN set_config('application_name', %s, true) END",
            [lock_id(key), application_name[:63]],
        )
        return cursor.fetchone()[0] is not None


def xact_lock(key: str) -> None:
    """Wait for the lock; it is released when the current transaction ends."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [lock_id(key)])


def tenant_lock_key(tenant_id: int) -> str:
    """The per-tenant critical section of membership changes (the last admin). Task
    creation and tenant deletion lock the tenant's usage row instead (apps.tasks)."""
    return f"tenant:{tenant_id}"
