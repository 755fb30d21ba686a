"""The node search (apps.nodes.selectors.NODE_SEARCH_SQL) reads one short text per node
instead of upper-casing nine columns of every node and every card:

- table `node_search` (node id → text): the upper-cased id, name, addresses, location and
  GPU model, joined by a unit separator so that a match never spans two fields. Triggers
  on `nodes` keep it, so no path that writes nodes (the heartbeat's raw SQL included) can
  forget it, and the row is rewritten only when one of those fields really changes: a
  steady heartbeat, which rewrites the node row every 5 s, does not touch it or its
  index. Not a model: nothing reads it but the search.
- trigram indexes on it and on the cards' upper-cased model, where the server has the
  pg_trgm extension (every packaged PostgreSQL has it in its contrib; the embedded one
  of `make up`, pgserver, does not: there the search reads the table, still quick at
  10,000 nodes);
- a partial index of the nodes whose cards are searched one by one (a `mixed` node, or
  one that never beat).
tests/nodes/test_node_search.py pins what it matches, when the row is written, and that
the plan uses the index."""

import logging

from django.db import migrations

logger = logging.getLogger(__name__)

SEARCH_TEXT = (
    "upper(N.id || E'\\x1f' || N.name || E'\\x1f' || coalesce(host(N.ip), '') || E'\\x1f' || "
    "coalesce(host(N.internal_ip), '') || E'\\x1f' || N.rack || E'\\x1f' || N.zone || E'\\x1f' || N.region || "
    "E'\\x1f' || N.gpu_model)"
)
SEARCHED = ("id", "name", "ip", "internal_ip", "rack", "zone", "region", "gpu_model")
CHANGED = " OR ".join(f"OLD.{column} IS DISTINCT FROM NEW.{column}" for column in SEARCHED)

CREATE = f"""
CREATE TABLE node_search (node_id varchar(128) PRIMARY KEY, text text NOT NULL);

CREATE FUNCTION node_search_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.id <> NEW.id THEN
        DELETE FROM node_search WHERE node_id = OLD.id;
    END IF;
    INSERT INTO node_search (node_id, text) VALUES (NEW.id, {SEARCH_TEXT.replace("N.", "NEW.")})
    ON CONFLICT (node_id) DO UPDATE SET text = EXCLUDED.text;
    RETURN NULL;
END $$;

CREATE FUNCTION node_search_forget() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE node_search;
    ELSE
        DELETE FROM node_search WHERE node_id = OLD.id;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER node_search_on_insert AFTER INSERT ON nodes
    FOR EACH ROW EXECUTE FUNCTION node_search_write();
CREATE TRIGGER node_search_on_update AFTER UPDATE ON nodes
    FOR EACH ROW WHEN ({CHANGED}) EXECUTE FUNCTION node_search_write();
CREATE TRIGGER node_search_on_delete AFTER DELETE ON nodes
    FOR EACH ROW EXECUTE FUNCTION node_search_forget();
CREATE TRIGGER node_search_on_truncate AFTER TRUNCATE ON nodes
    FOR EACH STATEMENT EXECUTE FUNCTION node_search_forget();

INSERT INTO node_search (node_id, text) SELECT N.id, {SEARCH_TEXT} FROM nodes N;

CREATE INDEX nodes_cards_searched ON nodes (id) WHERE gpu_model IN ('mixed', '');
"""

DROP = """
DROP TRIGGER IF EXISTS node_search_on_insert ON nodes;
DROP TRIGGER IF EXISTS node_search_on_update ON nodes;
DROP TRIGGER IF EXISTS node_search_on_delete ON nodes;
DROP TRIGGER IF EXISTS node_search_on_truncate ON nodes;
DROP FUNCTION IF EXISTS node_search_write();
DROP FUNCTION IF EXISTS node_search_forget();
DROP TABLE IF EXISTS node_search;
DROP INDEX IF EXISTS nodes_cards_searched;
DROP INDEX IF EXISTS gpus_model_search_trgm;
"""


def create(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(CREATE)
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pg_trgm')")
        if not cursor.fetchone()[0]:
            logger.warning("PostgreSQL has no pg_trgm extension: the node search reads the table (docs/api.md)")
            return
        cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm WITH SCHEMA public")
        cursor.execute("CREATE INDEX node_search_trgm ON node_search USING gin (text public.gin_trgm_ops)")
        cursor.execute("CREATE INDEX gpus_model_search_trgm ON gpus USING gin ((upper(model)) public.gin_trgm_ops)")


def drop(apps, schema_editor):
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("nodes", "0006_live_task_ids_unknown")]

    operations = [migrations.RunPython(create, drop)]
