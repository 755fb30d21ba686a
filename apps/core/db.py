"""Direct PostgreSQL access for the few paths that bypass the ORM (liveness probe, the
heartbeat hot path): connection parameters come from Django's own settings, so both
always talk to the same database, with the same options."""

from __future__ import annotations

from django.db import connections

# Keys of Django's OPTIONS that are not libpq connection parameters.
DJANGO_ONLY_OPTIONS = frozenset({"pool", "server_side_binding", "isolation_level", "assume_role"})


def libpq_params(alias: str = "default", **overrides) -> dict:
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
    return {key: value for key, value in params.items() if value is not None}
