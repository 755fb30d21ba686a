"""The quota's usage as a counter per tenant (tenant_usage), kept by triggers on tasks,
and initialised here from the tasks that exist."""

import django.db.models.deletion
from django.db import migrations, models

# The statuses the quota does not count (apps.tasks.choices.TERMINAL; a test pins that
# the two agree). A task counts while it is in any other status.
TERMINAL = "ARRAY['completed', 'failed', 'cancelled', 'stopped']::varchar[]"

# What one task row adds to its tenant's usage while it counts.
ROW = "{t}.tenant_id, 1 AS tasks, {t}.gpu_required::bigint AS gpus, " \
      "COALESCE({t}.gpu_memory_mb, 0) * GREATEST({t}.gpu_required, 1)::bigint AS gpu_memory_mb"

# Statement-level triggers with transition tables: one counter update per tenant per
# statement, however many rows it wrote (a batch of 10,000 is one upsert). An UPDATE
# adds what its new rows count and takes away what its old ones did, so a move that
# stays inside the counted set (pending → scheduled, a requeue) nets to nothing and
# touches no counter row. Counter rows are locked in tenant order, so two statements
# of many tenants cannot deadlock on them.
FUNCTION = f"""
CREATE OR REPLACE FUNCTION tenant_usage_apply() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    d record;
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO tenant_usage AS u (tenant_id, tasks, gpus, gpu_memory_mb)
        SELECT tenant_id, sum(tasks), sum(gpus), sum(gpu_memory_mb)
        FROM (SELECT {ROW.format(t="n")} FROM new_rows n WHERE n.status <> ALL ({TERMINAL})) AS added
        GROUP BY tenant_id ORDER BY tenant_id
        ON CONFLICT (tenant_id) DO UPDATE SET tasks = u.tasks + EXCLUDED.tasks, gpus = u.gpus + EXCLUDED.gpus,
            gpu_memory_mb = u.gpu_memory_mb + EXCLUDED.gpu_memory_mb;
        RETURN NULL;
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        UPDATE tenant_usage SET tasks = 0, gpus = 0, gpu_memory_mb = 0;
        RETURN NULL;
    END IF;
    -- take away what the old rows counted less what the new ones count (a DELETE has
    -- no new rows; each branch names only the transition tables its statement has)
    IF TG_OP = 'UPDATE' THEN
        FOR d IN
            SELECT tenant_id, sum(tasks) AS tasks, sum(gpus) AS gpus, sum(gpu_memory_mb) AS gpu_memory_mb FROM (
                SELECT {ROW.format(t="o")} FROM old_rows o WHERE o.status <> ALL ({TERMINAL})
                UNION ALL
                SELECT n.tenant_id, -1, -n.gpu_required::bigint, -(COALESCE(n.gpu_memory_mb, 0) * GREATEST(n.gpu_required, 1))::bigint
                FROM new_rows n WHERE n.status <> ALL ({TERMINAL})
            ) AS removed
            GROUP BY tenant_id HAVING sum(tasks) <> 0 OR sum(gpus) <> 0 OR sum(gpu_memory_mb) <> 0 ORDER BY tenant_id
        LOOP
            UPDATE tenant_usage SET tasks = tasks - d.tasks, gpus = gpus - d.gpus,
                gpu_memory_mb = gpu_memory_mb - d.gpu_memory_mb WHERE tenant_id = d.tenant_id;
        END LOOP;
    ELSE
        FOR d IN
            SELECT tenant_id, sum(tasks) AS tasks, sum(gpus) AS gpus, sum(gpu_memory_mb) AS gpu_memory_mb FROM (
                SELECT {ROW.format(t="o")} FROM old_rows o WHERE o.status <> ALL ({TERMINAL})
            ) AS removed
            GROUP BY tenant_id ORDER BY tenant_id
        LOOP
            UPDATE tenant_usage SET tasks = tasks - d.tasks, gpus = gpus - d.gpus,
                gpu_memory_mb = gpu_memory_mb - d.gpu_memory_mb WHERE tenant_id = d.tenant_id;
        END LOOP;
    END IF;
    RETURN NULL;
END $$;
"""

TRIGGERS = """
CREATE TRIGGER tenant_usage_on_insert AFTER INSERT ON tasks
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tenant_usage_apply();
CREATE TRIGGER tenant_usage_on_update AFTER UPDATE ON tasks
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tenant_usage_apply();
CREATE TRIGGER tenant_usage_on_delete AFTER DELETE ON tasks
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION tenant_usage_apply();
CREATE TRIGGER tenant_usage_on_truncate AFTER TRUNCATE ON tasks
    FOR EACH STATEMENT EXECUTE FUNCTION tenant_usage_apply();
"""

INITIALISE = f"""
INSERT INTO tenant_usage (tenant_id, tasks, gpus, gpu_memory_mb)
SELECT t.id, COALESCE(sum(a.tasks), 0), COALESCE(sum(a.gpus), 0), COALESCE(sum(a.gpu_memory_mb), 0)
FROM tenants t
LEFT JOIN (SELECT {ROW.format(t="k")} FROM tasks k WHERE k.status <> ALL ({TERMINAL})) AS a ON a.tenant_id = t.id
GROUP BY t.id;
"""

DROP = """
DROP TRIGGER IF EXISTS tenant_usage_on_insert ON tasks;
DROP TRIGGER IF EXISTS tenant_usage_on_update ON tasks;
DROP TRIGGER IF EXISTS tenant_usage_on_delete ON tasks;
DROP TRIGGER IF EXISTS tenant_usage_on_truncate ON tasks;
DROP FUNCTION IF EXISTS tenant_usage_apply();
"""


class Migration(migrations.Migration):

    dependencies = [
        ("tasks", "0009_usage_and_missing"),
        ("tenants", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="TenantUsage",
            fields=[
                ("tenant", models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, primary_key=True,
                                                related_name="quota_usage", serialize=False, to="tenants.tenant")),
                ("tasks", models.BigIntegerField(default=0, help_text="active tasks")),
                ("gpus", models.BigIntegerField(default=0, help_text="GPUs the active tasks ask for")),
                ("gpu_memory_mb", models.BigIntegerField(default=0, help_text="GPU memory they ask for, per GPU asked")),
            ],
            options={"db_table": "tenant_usage"},
        ),
        # no task is written between the triggers' creation and the count that starts the
        # counters (CREATE TRIGGER takes this lock too; written out so that it is plain)
        migrations.RunSQL("LOCK TABLE tasks IN SHARE ROW EXCLUSIVE MODE;" + FUNCTION + TRIGGERS + INITIALISE, DROP),
    ]
