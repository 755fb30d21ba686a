"""Compare-and-set state transitions: the one way a row's status changes.

Every transition is checked against the model's allowed-transition table before the
database is touched, so an illegal transition is refused in code, never attempted. Then
one statement (`cas_sql`) locks the rows still in a source status, in key order (two
multi-row moves over the same rows queue instead of deadlocking), and updates them:

    WITH won AS (SELECT id FROM tasks WHERE id = ANY(%s) AND status = ANY(%s)
                 ORDER BY id FOR UPDATE)
    UPDATE tasks SET status = %s, <column = %s or an expression …>, <column = v.column …>
    FROM won [JOIN unnest(%s::bigint[], …) AS v(id, …) ON v.id = won.id]
    WHERE tasks.id = won.id RETURNING tasks.id …

A row a concurrent writer moved is re-checked after its lock is released (PostgreSQL
re-evaluates the locking query's WHERE on the committed row), so of two racers exactly
one sees the source status; the caller learns which keys won, and a loser changes
nothing. `transition` (every task move, through apps.tasks.services.move_tasks) writes
the same values to every row; the scheduler's bind writes a node and a host port per
row (`per_row`). Both are `compare_and_set`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from django.db import connection, models
from django.db.models.sql import UpdateQuery

from apps.core.clock import utcnow


class IllegalTransition(ValueError):
    pass


class Sql(NamedTuple):
    """A column's new value as SQL over the row's own columns (`preempt_count + 1`)."""

    text: str
    params: list


def check_transition(table: Mapping[str, frozenset[str]], from_statuses: Iterable[str], to_status: str) -> list[str]:
    sources = list(from_statuses)
    if not sources:
        raise IllegalTransition("a transition needs at least one source status")
    illegal = [source for source in sources if to_status not in table.get(source, frozenset())]
    if illegal:
        raise IllegalTransition(f"{', '.join(illegal)} → {to_status} is not an allowed transition")
    return sources


def cas_sql(
    db_table: str,
    *,
    fixed: Sequence[tuple[str, str]] = (),
    per_row: Sequence[tuple[str, str]] = (),
    returning: str = "",
) -> str:
    """The compare-and-set statement over `db_table` (its key `id`, its state `status`).
    `fixed`: (column, SQL of its value) pairs written to every row; `per_row`: (column,
    PostgreSQL type) pairs whose values come as arrays aligned with the keys. Parameters,
    in order: the keys, the source statuses, the target status, the `fixed` values'
    parameters, then (with `per_row`) the keys again and one array per column.
    `returning`: more of the table's columns or expressions after its id."""
    sets = [
        "status = %s",
        *(f"{column} = {value}" for column, value in fixed),
        *(f"{column} = v.{column}" for column, _ in per_row),
    ]
    source = "won"
    if per_row:
        arrays = ", ".join(["%s::bigint[]", *(f"%s::{kind}[]" for _, kind in per_row)])
        columns = ", ".join(["id", *(column for column, _ in per_row)])
        source = f"won JOIN unnest({arrays}) AS v({columns}) ON v.id = won.id"
    extra = f", {returning}" if returning else ""
    return (
        f"WITH won AS (SELECT id FROM {db_table} WHERE id = ANY(%s) AND status = ANY(%s) ORDER BY id FOR UPDATE) "
        f"UPDATE {db_table} SET {', '.join(sets)} FROM {source} WHERE {db_table}.id = won.id "
        f"RETURNING {db_table}.id{extra}"
    )


def compare_and_set(
    db_table: str,
    table: Mapping[str, frozenset[str]],
    keys: Sequence,
    from_statuses: Iterable[str],
    to_status: str,
    *,
    fixed: Mapping[str, object] | None = None,
    per_row: Mapping[str, tuple[str, Sequence]] | None = None,
    returning: str = "",
) -> list[tuple]:
    """Move the rows `keys` from any of `from_statuses` to `to_status`, writing the
    `fixed` column values (a value, or `Sql`) to every row and the `per_row` columns'
    values (column → (PostgreSQL type, values aligned with `keys`)) row by row. Returns
    the winners' rows (id first, then `returning`), in key order."""
    sources = check_transition(table, from_statuses, to_status)
    keys = list(keys)
    if not keys:
        return []
    fixed = dict(fixed or {})
    per_row = dict(per_row or {})
    values = {column: value if isinstance(value, Sql) else Sql("%s", [value]) for column, value in fixed.items()}
    sql = cas_sql(
        db_table,
        fixed=[(column, value.text) for column, value in values.items()],
        per_row=[(column, kind) for column, (kind, _) in per_row.items()],
        returning=returning,
    )
    params = [keys, sources, to_status, *(param for value in values.values() for param in value.params)]
    if per_row:
        params += [keys, *(list(values) for _, values in per_row.values())]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return sorted(cursor.fetchall(), key=lambda row: row[0])


def transition(
    model: type[models.Model],
    table: Mapping[str, frozenset[str]],
    pks,
    from_statuses: Iterable[str],
    to_status: str,
    **changes,
) -> list:
    """Move the rows `pks` (one key or several) of `model` from any of `from_statuses` to
    `to_status`, with `changes` (model field names and values, as for
    `QuerySet.update`) written in the same statement. Returns the keys that won."""
    single = not isinstance(pks, (list, tuple, set, frozenset))
    keys = [pks] if single else list(pks)
    if any(field.name == "updated_at" for field in model._meta.concrete_fields) and "updated_at" not in changes:
        changes["updated_at"] = utcnow()
    won = compare_and_set(
        model._meta.db_table, table, keys, from_statuses, to_status, fixed=column_values(model, changes)
    )
    return [row[0] for row in won]


def column_values(model: type[models.Model], changes: Mapping[str, object]) -> dict[str, object]:
    """`QuerySet.update`'s keyword arguments as column → value or `Sql`, the way Django's
    UPDATE compiles them (a model instance as its key, an F() expression as SQL)."""
    query = UpdateQuery(model)
    query.add_update_values(changes)
    compiler = query.get_compiler(connection=connection)
    columns = {}
    for field, _, value in query.values:
        if hasattr(value, "resolve_expression"):
            text, params = compiler.compile(value.resolve_expression(query, allow_joins=False, for_save=True))
            columns[field.column] = Sql(text, list(params))
        else:
            if hasattr(value, "prepare_database_save"):
                value = value.prepare_database_save(field) if field.remote_field else value
            columns[field.column] = field.get_db_prep_save(value, connection)
    return columns
