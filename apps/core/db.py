"""Direct PostgreSQL access for the few paths that bypass the ORM (liveness probe, the
heartbeat hot path): connection parameters come from Django's own settings, so both
always talk to the same database, with the same options."""

from __future__ import annotations

import asyncio
import logging
import select
from functools import cache

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections

logger = logging.getLogger(__name__)

# Keys of Django's OPTIONS that are not libpq connection parameters.
DJANGO_ONLY_OPTIONS = frozenset({"pool", "server_side_binding", "isolation_level", "assume_role"})


def libpq_params(alias: str = "default", server_settings: dict | None = None, **overrides) -> dict:
    """The connection's libpq parameters; `server_settings` (name → value) are set for the
    session, after any `options` of the database's settings."""
    db = connections[alias].settings_dict
    params = {key: value for key, value in (db.get("OPTIONS") or {}).items() if key not in DJANGO_ONLY_OPTIONS}
    params.update(
        host=db.get("HOST") or None,
        port=db.get("PORT") or None,
        dbname=db.get("NAME"),
        user=db.get("USER") or None,
        password=db.get("PASSWORD") or None,
    )
    params.update(overrides)
    if server_settings:
        settings_given = [f"-c {name}={value}" for name, value in server_settings.items()]
        params["options"] = " ".join([params.get("options") or "", *settings_given]).strip()
    return {key: value for key, value in params.items() if value is not None}


async def check_idle_connection(conn) -> None:
    """A pool's `check` for the hot paths' async pools (heartbeat, gateway) that costs no
    round trip: an idle connection has nothing to read, so a socket that is readable
    holds the server's farewell (a terminated backend's FATAL, a restart's EOF), and the
    connection is dead. Raising makes the pool drop it and hand out another, so a
    connection the database ended fails no request. (psycopg_pool's own check_connection
    sends a query each time: one more round trip on every beat.)"""
    if conn.closed or conn.broken:
        raise psycopg.OperationalError("the connection is closed")
    readable, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    if readable:
        # closed here: libpq has not read the farewell yet, so the pool would take the
        # connection back as healthy
        await conn.close()
        raise psycopg.OperationalError("the server ended this idle connection")


class LoopPool:
    """An async connection pool for the running event loop (a pool belongs to the loop it
    was opened on; a test or a restarted loop gets a new one), in autocommit mode, whose
    connections are checked when taken (check_idle_connection). `size` is read when the
    pool is made (a setting's callable, so tests may change it)."""

    def __init__(self, size, **params):
        self.size, self.params = size, params
        self._pool = None
        self._loop = None

    async def get(self):
        from psycopg_pool import AsyncConnectionPool  # noqa: PLC0415  (not every process uses one)

        loop = asyncio.get_running_loop()
        if self._pool is None or self._loop is not loop:
            self._pool = AsyncConnectionPool(
                kwargs=libpq_params(autocommit=True, **self.params),
                min_size=1,
                max_size=self.size(),
                open=False,
                timeout=5.0,
                check=check_idle_connection,
            )
            await self._pool.open()
            self._loop = loop
        return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None


async def on_live_connection(pool, work):
    """`await work(conn)` on a connection of `pool` (one of the hot paths' async pools),
    once more on another connection when the one it ran on was ended by the server
    before its farewell arrived (pg_terminate_backend returns before the backend has said
    goodbye, so the pool's check can still pass): the statement then failed on a broken
    connection, where the server ran none of it. Every pooled connection may have been
    ended at once (a restart), so up to the pool's size + 1 tries: the last is on a
    connection opened after the others were dropped. For work that is one statement or
    one transaction, which the server then did not commit; any other failure is raised."""
    tries = pool.max_size + 1
    for attempt in range(1, tries + 1):
        async with pool.connection() as conn:
            try:
                return await work(conn)
            except psycopg.OperationalError:
                if attempt == tries or not conn.broken:
                    raise
                logger.info("a pooled connection was gone; the work runs once more on another")
    raise AssertionError("unreachable")


# --- rows in and out of models without building an ORM query per call -----------------------
# For the submission hot path (a task create, its API key): building a queryset's SQL costs
# more than running it there. These do what the ORM does for the plain cases they take.


@cache
def _columns(model, alias: str):
    """(quoted `alias.column` list, attnames, each field's converters) of a model's
    concrete fields, in _meta order: what a SELECT of the model would read."""
    conn = connections[DEFAULT_DB_ALIAS]
    quote = conn.ops.quote_name
    fields = model._meta.concrete_fields
    select = ", ".join(f"{alias}.{quote(field.column)}" for field in fields)
    converters = [
        (field, conn.ops.get_db_converters(field.get_col(alias)) + field.get_db_converters(conn)) for field in fields
    ]
    return select, [field.attname for field in fields], converters


def select_list(model, alias: str) -> str:
    """The columns to SELECT for `model_from_row(model, …)`, qualified by `alias`."""
    return _columns(model, alias)[0]


def column_count(model) -> int:
    return len(model._meta.concrete_fields)


def model_from_row(model, values, alias: str, using: str = DEFAULT_DB_ALIAS):
    """The model instance the ORM would have made of these values (read by
    `select_list(model, alias)`), the fields' database converters applied."""
    _, attnames, converters = _columns(model, alias)
    conn = connections[using]
    values = list(values)
    for i, (field, field_converters) in enumerate(converters):
        for converter in field_converters:
            values[i] = converter(values[i], field.get_col(alias), conn)
    return model.from_db(using, attnames, values)


FEW_ROWS = 10  # insert_rows' own INSERT up to this many rows


@cache
def _insert_plan(model):
    opts = model._meta
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    fields = [field for field in opts.concrete_fields if field is not opts.auto_field and not field.generated]
    returning = list(opts.db_returning_fields)
    head = f"INSERT INTO {quote(opts.db_table)} ({', '.join(quote(field.column) for field in fields)}) VALUES "
    row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    tail = f" RETURNING {', '.join(quote(field.column) for field in returning)}" if returning else ""
    return fields, head, row, tail, returning


def insert_rows(objs, *, batch_size: int = 1000, using: str = DEFAULT_DB_ALIAS) -> list:
    """Model.objects.bulk_create(objs) for a few new rows of one model with plain values
    (no expressions): one INSERT … VALUES … RETURNING, the returned ids set on the
    objects, without compiling a query. Anything else is left to bulk_create."""
    objs = list(objs)
    if not objs:
        return objs
    model = type(objs[0])
    if len(objs) > FEW_ROWS:  # many rows: bulk_create's one-array-per-column INSERT is faster
        return model._default_manager.db_manager(using).bulk_create(objs, batch_size=batch_size)
    fields, head, row, tail, returning = _insert_plan(model)
    conn = connections[using]
    rows = []
    for obj in objs:
        obj._prepare_related_fields_for_save(operation_name="bulk_create")
        values = [field.pre_save(obj, True) for field in fields]
        if obj.pk is not None or any(hasattr(value, "resolve_expression") for value in values):
            return model._default_manager.db_manager(using).bulk_create(objs, batch_size=batch_size)
        rows.append(
            [field.get_db_prep_save(value, connection=conn) for field, value in zip(fields, values, strict=True)]
        )
    with conn.cursor() as cursor:
        cursor.execute(head + ", ".join([row] * len(rows)) + tail, [value for values in rows for value in values])
        returned = cursor.fetchall() if returning else [()] * len(rows)
    # each returned value as the ORM would give it (a jsonb db_default comes back as text)
    columns = [field.get_col(model._meta.db_table) for field in returning]
    converters = [[*conn.ops.get_db_converters(column), *column.get_db_converters(conn)] for column in columns]
    for obj, values in zip(objs, returned, strict=True):
        for field, column, convert, value in zip(returning, columns, converters, values, strict=True):
            for converter in convert:
                value = converter(value, column, conn)
            setattr(obj, field.attname, value)
        obj._state.adding = False
        obj._state.db = using
    return objs
