"""What a heartbeat's writes cost in indexes (migration nodes/0015): the cards' rows keep
room on their pages so that a beat's update of their readings is HOT (no index written),
and no index of `nodes` or `gpus`, which a beat writes, duplicates another."""

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db

INDEXES = """
SELECT i.relname, x.indisunique, x.indpred IS NOT NULL,
       ARRAY(SELECT a.attname FROM unnest(x.indkey) WITH ORDINALITY AS k(attnum, n)
             JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum ORDER BY k.n)
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
WHERE x.indrelid = to_regclass(%s) AND i.relam = (SELECT oid FROM pg_am WHERE amname = 'btree')
"""


def btree_indexes(table: str) -> list[tuple[str, bool, bool, list[str]]]:
    with connection.cursor() as cursor:
        cursor.execute(INDEXES, [table])
        return cursor.fetchall()


@pytest.mark.parametrize("table", ["nodes", "gpus"])
def test_no_index_a_beat_writes_is_covered_by_another(table):
    indexes = btree_indexes(table)
    covered = [
        (name, other)
        for name, unique, partial, columns in indexes
        for other, _, other_partial, other_columns in indexes
        if name != other
        and not unique
        and not partial
        and not other_partial
        and other_columns[: len(columns)] == columns
        and (len(other_columns) > len(columns) or name > other)  # of two alike, one is reported
    ]
    assert covered == [], f"{table}: an index that another already serves costs every beat a write: {covered}"


def test_the_cards_pages_keep_room_for_the_beats_hot_updates():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, reloptions FROM pg_class WHERE oid IN (to_regclass('gpus'), to_regclass('nodes'))"
        )
        options = dict(cursor.fetchall())
    assert "fillfactor=50" in options["gpus"] and "fillfactor=70" in options["nodes"]
