"""A faster flush after each transactional test (django_db(transaction=True)).

Django empties the database after such a test with one TRUNCATE of every table (about
sixty here), then re-creates the content types and permissions it just truncated: close
to a second per test, most of it PostgreSQL creating new files for tables that were empty
anyway. Here the TRUNCATE names only the tables that hold a row (one query finds them),
CASCADE for the empty ones that point at them, and leaves the content types and
permissions alone (post_migrate would write the same rows again). What a test sees after
the flush is the same: every table of Django's flush that held data is empty."""

from __future__ import annotations

from django.db.backends.postgresql.operations import DatabaseOperations

# What post_migrate re-creates after a flush, identically: left in place.
KEPT = frozenset({"django_content_type", "auth_permission"})
# Tables of no model (Django's flush does not know them) keyed by ids the flush restarts:
# emptied too, or a later test's task 1 would find an earlier task 1's log lines.
UNMODELLED = ("task_log_chunks",)

_django_sql_flush = DatabaseOperations.sql_flush


def sql_flush_of_tables_with_rows(self, style, tables, *, reset_sequences=False, allow_cascade=False):
    candidates = [table for table in (*tables, *UNMODELLED) if table not in KEPT]
    if not candidates:
        return []
    quote = self.quote_name
    probe = " UNION ALL ".join(f"(SELECT {i} FROM {quote(table)} LIMIT 1)" for i, table in enumerate(candidates))
    with self.connection.cursor() as cursor:
        cursor.execute(probe)
        holding = [candidates[i] for (i,) in cursor.fetchall()]
    if not holding:
        return []
    return _django_sql_flush(self, style, holding, reset_sequences=reset_sequences, allow_cascade=True)


def install() -> None:
    DatabaseOperations.sql_flush = sql_flush_of_tables_with_rows


def empty_database() -> None:
    """What a transactional test's teardown does, for a fixture that outlives its tests:
    a module's control plane and agent keep writing after its last test's flush (a beat
    registers the node again), and a later test on the same database would find it."""
    from django.core.management import call_command

    call_command("flush", verbosity=0, interactive=False, allow_cascade=True)
