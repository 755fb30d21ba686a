"""Task logs stored a chunk a row (apps.tasks.logs): each task's lines of one agent batch
in one row, their JSON text compressed with lz4 where the server was built with it (the
embedded PostgreSQL is not: there the text is stored uncompressed, pglz costing the
ingestion more CPU than it saves). The stored lines move over one chunk a line."""

from django.db import migrations

from apps.core.partitions import DailyTable

TASK_LOG_CHUNKS = DailyTable("task_log_chunks", "received_at")


def lz4_available(cursor) -> bool:
    cursor.execute("SAVEPOINT lz4_probe")
    try:
        cursor.execute("SET LOCAL default_toast_compression = 'lz4'")
    except Exception:  # noqa: BLE001  (a server built without lz4 refuses the value)
        cursor.execute("ROLLBACK TO SAVEPOINT lz4_probe")
        return False
    cursor.execute("RELEASE SAVEPOINT lz4_probe")
    cursor.execute("RESET default_toast_compression")
    return True


def create_chunks(apps, schema_editor):
    from apps.core.clock import utcnow

    with schema_editor.connection.cursor() as cursor:
        # set on the parent before any partition exists, which each partition then takes
        # (ALTER, not a column clause: CREATE TABLE takes STORAGE only from PostgreSQL 16)
        storage = "COMPRESSION lz4" if lz4_available(cursor) else "STORAGE EXTERNAL"
        cursor.execute(f"""
            CREATE TABLE task_log_chunks (
                task_id bigint NOT NULL,
                first_seq bigint NOT NULL,
                last_seq bigint NOT NULL,
                base bigint NOT NULL,
                received_at timestamptz NOT NULL,
                bytes integer NOT NULL,
                lines text NOT NULL
            ) PARTITION BY RANGE (received_at);
            ALTER TABLE task_log_chunks ALTER COLUMN lines SET {storage};
            CREATE INDEX task_log_chunks_task_seq ON task_log_chunks (task_id, last_seq);
            CREATE TABLE task_log_chunks_default PARTITION OF task_log_chunks DEFAULT;
        """)
        TASK_LOG_CHUNKS.ensure_partitions(cursor, utcnow().date())
        cursor.execute("""
            INSERT INTO task_log_chunks (task_id, first_seq, last_seq, base, received_at, bytes, lines)
            SELECT task_id, seq, seq, seq, received_at, octet_length(chunk), chunk
            FROM (SELECT task_id, seq, received_at,
                         json_build_array(json_build_array(0, extract(epoch FROM at),
                                                           (ARRAY['stdout', 'stderr', 'system'])[stream + 1],
                                                           text))::text AS chunk
                  FROM task_log_lines) AS l
        """)
        cursor.execute("""
            UPDATE task_log_state AS s SET stored_bytes = COALESCE(
                (SELECT sum(bytes) FROM task_log_chunks AS c WHERE c.task_id = s.task_id), 0)
        """)
        cursor.execute("DROP TABLE task_log_lines CASCADE")


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0019_placement_constraints"),
    ]

    operations = [migrations.RunPython(create_chunks, migrations.RunPython.noop)]
