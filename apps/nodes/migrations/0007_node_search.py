"""The node search (apps.nodes.selectors.NODE_SEARCH_SQL) reads one stored column instead
of upper-casing nine columns of every node and every card:

- `nodes.search_text`, a generated column (PostgreSQL computes it on every write, so no
  path that writes nodes, the heartbeat's raw SQL included, can forget it; the ORM does
  not map it): the upper-cased id, name, addresses, location and GPU model, joined by a
  unit separator so that a match never spans two fields;
- trigram indexes on it and on the cards' upper-cased model, where the server has the
  pg_trgm extension (every packaged PostgreSQL has it in its contrib; the embedded one
  of `make up`, pgserver, does not: there the search reads the column, still fast at
  10,000 nodes);
- a partial index of the nodes whose cards must be read one by one (a `mixed` node, or
  one that never beat).
tests/nodes/test_node_search.py checks the plan uses them where pg_trgm is present."""

import logging

from django.db import migrations

logger = logging.getLogger(__name__)

SEARCH_TEXT = (
    "upper(id || E'\\x1f' || name || E'\\x1f' || coalesce(host(ip), '') || E'\\x1f' || "
    "coalesce(host(internal_ip), '') || E'\\x1f' || rack || E'\\x1f' || zone || E'\\x1f' || region || "
    "E'\\x1f' || gpu_model)"
)
TRIGRAM_INDEXES = {
    "nodes_search_trgm": "nodes USING gin (search_text public.gin_trgm_ops)",
    "gpus_model_search_trgm": "gpus USING gin ((upper(model)) public.gin_trgm_ops)",
}


def create(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE nodes ADD COLUMN search_text text GENERATED ALWAYS AS ({SEARCH_TEXT}) STORED")
        cursor.execute("CREATE INDEX nodes_cards_searched ON nodes (id) WHERE gpu_model IN ('mixed', '')")
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm')")
        if not cursor.fetchone()[0]:
            logger.warning("PostgreSQL has no pg_trgm extension: the node search reads the table (docs/nodes.md)")
            return
        cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm WITH SCHEMA public")
        for name, definition in TRIGRAM_INDEXES.items():
            cursor.execute(f"CREATE INDEX {name} ON {definition}")


def drop(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        for name in [*TRIGRAM_INDEXES, "nodes_cards_searched"]:
            cursor.execute(f"DROP INDEX IF EXISTS {name}")
        cursor.execute("ALTER TABLE nodes DROP COLUMN IF EXISTS search_text")


class Migration(migrations.Migration):
    dependencies = [("nodes", "0006_live_task_ids_unknown")]

    operations = [migrations.RunPython(create, drop)]
