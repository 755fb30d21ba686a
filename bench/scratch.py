"""A scratch control-plane database for in-process benchmarks: Django set up in
production mode on a database of the benchmark's own (dropped before and after), on
DATABASE_URL's server when set, else on an embedded PostgreSQL in a scratch folder."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from bench.heartbeats import drop_database, recreate_database
from heteroflow.embedded import ensure_data_stores


@contextlib.contextmanager
def scratch_django(db_name: str, prefix: str, *, keep: bool = False):
    """Yields once Django is set up and migrated on `db_name`. `keep`: leave the database
    for EXPLAIN by hand (only meaningful with DATABASE_URL)."""

    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    stores = ensure_data_stores(scratch, os.environ)
    admin_url = stores.database_url
    database_url = recreate_database(admin_url, db_name)
    os.environ.update(
        DATABASE_URL=database_url,
        REDIS_URL=stores.redis_url,
        HETEROFLOW_ENV="production",
        SECRET_KEY=secrets.token_urlsafe(50),
        HETEROFLOW_AGENT_SECRET=secrets.token_urlsafe(24),
        ALLOWED_HOSTS="localhost",
        HETEROFLOW_DATA_DIR=str(scratch),
        HETEROFLOW_LOG_LEVEL="warning",
        DJANGO_SETTINGS_MODULE="heteroflow.settings",
    )
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate_schemas", interactive=False, verbosity=0)
        yield
    finally:
        from django.db import connections

        connections.close_all()
        if not keep:
            drop_database(admin_url, db_name)
        stores.stop()
        shutil.rmtree(scratch, ignore_errors=True)
