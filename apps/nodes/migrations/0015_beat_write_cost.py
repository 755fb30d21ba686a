"""What a heartbeat's writes cost: fewer indexes to write, and room on the pages.

A beat rewrites its node's row and each of its cards' rows. An update that changes no
indexed column and finds room on its page is a HOT update: no index is written. The
cards' readings are not indexed, so with room left on their pages (fillfactor 50: the
cards are a few thousand short rows) their updates stay HOT; at the default 100, `make
bench` saw 55 % of them HOT, each of the others writing every index of `gpus`. The node's
row changes `last_heartbeat_at`, which is indexed, so its update writes every index of
`nodes`: three were duplicates of others (`nodes_tenant` of the tenant foreign key's;
the `varchar_pattern_ops` twins Django adds for an indexed text column, of the id's
primary key and of the GPU type's index: nothing matches either by LIKE; the search
reads `node_search`), and the
cards' foreign key index and its `_like` twin duplicate the (node, index) constraint's.

Existing pages keep their fill until rewritten (VACUUM FULL gpus, nodes; or as rows
move); new ones get the room at once.
"""

import django.db.models.deletion
from django.db import migrations, models

# Django names it with a hash (nodes_id_<hash>_like): found by what it indexes.
DROP_ID_PATTERN_INDEX = """
DO $$
DECLARE name text;
BEGIN
    FOR name IN
        SELECT i.relname FROM pg_index x
        JOIN pg_class i ON i.oid = x.indexrelid
        JOIN pg_opclass o ON o.oid = x.indclass[0]
        WHERE x.indrelid = to_regclass('nodes') AND x.indnatts = 1 AND o.opcname = 'varchar_pattern_ops'
          AND pg_get_indexdef(x.indexrelid) LIKE '%(id varchar_pattern_ops)'
    LOOP
        EXECUTE format('DROP INDEX %I', name);
    END LOOP;
END $$;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0014_card_identity"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="node", name="nodes_tenant"),
        migrations.AlterField(
            model_name="gpu",
            name="node",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="gpus",
                to="nodes.node",
            ),
        ),
        migrations.AlterField(
            model_name="node",
            name="gpu_type",
            field=models.CharField(blank=True, default="", max_length=20),
        ),
        migrations.AddIndex(model_name="node", index=models.Index(fields=["gpu_type"], name="nodes_gpu_type")),
        migrations.RunSQL(
            DROP_ID_PATTERN_INDEX, "CREATE INDEX nodes_id_like ON nodes (id varchar_pattern_ops)", elidable=False
        ),
        migrations.RunSQL(
            "ALTER TABLE gpus SET (fillfactor = 50); ALTER TABLE nodes SET (fillfactor = 70)",
            "ALTER TABLE gpus RESET (fillfactor); ALTER TABLE nodes RESET (fillfactor)",
            elidable=False,
        ),
    ]
