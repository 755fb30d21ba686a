"""Schemathesis over the whole OpenAPI schema (issue 20), in process against the Django
application, as four principals: an operator key, a tenant admin's key, a tenant
viewer's key and the agent key. For every operation and principal it generates cases
from the schema and checks: no 5xx, every answer's status, content type, headers and body
match the schema, and a request with wrong credentials is never served. It also counts
the operations each principal got past the door of (an answer other than 401/403), so a
run that only ever knocks is visible.

HETEROFLOW_FUZZ_EXAMPLES (default 3) sets the cases per operation and principal.
Schemathesis' own pytest plugin does not load under this pytest, so the operations are
walked here with Hypothesis directly."""

from __future__ import annotations

import logging
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import checks

from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db

EXAMPLES = int(os.environ.get("HETEROFLOW_FUZZ_EXAMPLES", "3"))
WRONG_KEY = {"Authorization": "Bearer sk-tenant-this-key-was-never-issued-anywhere"}
# operations anybody may call (public documentation and probes)
# what the issue asks of every answer; not the checks that judge business rules from the
# schema alone (positive_data_acceptance would call an e-mail channel with no recipient
# "valid data rejected")
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.ignored_auth,
]
PUBLIC = {"/api/schema/", "/api/v1/agent/dist/", "/api/v1/agent/dist/{arch}/", "/api/v1/agent/dist/{arch}/{filename}"}


@pytest.fixture
def keep_connection():
    """The application runs in this test's transaction: Django must not close the
    connection at the end of each request (the test client does the same)."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def quiet():
    """Thousands of refused requests would each log a warning (set after the WSGI
    application is made: making it configures logging again)."""
    logger = logging.getLogger("django.request")
    level = logger.level
    yield lambda: logger.setLevel(logging.ERROR)
    logger.setLevel(level)


def principals(world) -> dict[str, dict]:
    return {
        "operator": bearer(world.operator_key),
        "tenant-admin": bearer(world.keys["acme-admin"]),
        "tenant-viewer": bearer(world.keys["acme-viewer"]),
        "agent": {"X-API-Key": AGENT["HTTP_X_API_KEY"]},
    }


def as_headers(django_headers: dict) -> dict:
    """The test helpers' Django-style headers (HTTP_AUTHORIZATION) as HTTP headers."""
    return {
        name.removeprefix("HTTP_").replace("_", "-").title() if name.startswith("HTTP_") else name: value
        for name, value in django_headers.items()
    }


def routes(path: str) -> bool:
    """Whether the path reaches a view at all (a generated slug the URL's converter
    refuses gets the catch-all JSON 404 before anybody is asked for credentials)."""
    from django.urls import Resolver404, resolve

    from apps.core import errors

    try:
        view = resolve(path).func
    except Resolver404:
        return False
    return getattr(view, "__wrapped__", view) is not errors.not_found


WRITES = {"POST", "PUT", "PATCH", "DELETE"}
_COUNT_SQL: list[str] = []


def row_counts() -> dict[str, int]:
    """Rows in every table of every schema (public and the tenants'), in one statement:
    a refused write must leave every count as it was."""
    from django.db import connection

    with connection.cursor() as cursor:
        if not _COUNT_SQL:
            cursor.execute(
                "SELECT quote_ident(schemaname) || '.' || quote_ident(tablename) FROM pg_tables "
                "WHERE schemaname NOT IN ('pg_catalog', 'information_schema') AND tablename NOT LIKE 'node_metrics_%%' "
                "ORDER BY 1"
            )
            tables = [row[0] for row in cursor.fetchall()]
            _COUNT_SQL[:] = [
                "SELECT " + ", ".join(f"(SELECT count(*) FROM {table})" for table in tables),
                *tables,
            ]
        cursor.execute(_COUNT_SQL[0])
        return dict(zip(_COUNT_SQL[1:], cursor.fetchone(), strict=True))


def fuzzer(operation, who: str, headers: dict, tally: dict):
    """The Hypothesis test of one operation as one principal; counts into `tally`."""
    label = f"{operation.method.upper()} {operation.path}"

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found, at once
    )
    def fuzz(case):
        tally["cases"] += 1
        writes = operation.method.upper() in WRITES
        before = row_counts() if writes else None
        response = case.call_and_validate(headers=headers, checks=CHECKS)
        if writes and 400 <= response.status_code < 500:
            after = row_counts()
            changed = {
                table: (before[table], after.get(table)) for table in before if before[table] != after.get(table)
            }
            assert not changed, f"a refused write ({response.status_code}) changed rows: {changed}"
            tally["refused_writes"] += 1
        if response.status_code not in (401, 403):
            tally["reached"].setdefault(label, set()).add(who)
        if operation.path not in PUBLIC and routes(case.formatted_path):
            wrong = case.call(headers=WRONG_KEY)
            assert wrong.status_code == 401, f"wrong credentials answered {wrong.status_code}"

    return fuzz


def test_every_operation_answers_by_its_schema_for_every_principal(world, keep_connection, quiet):
    from django.core.wsgi import get_wsgi_application

    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())
    quiet()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 50, "the schema lost its operations"
    tally, failures = {"cases": 0, "reached": {}, "refused_writes": 0}, []
    for operation in operations:
        for who, django_headers in principals(world).items():
            try:
                fuzzer(operation, who, as_headers(django_headers), tally)()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # schemathesis' FailureGroup: collected, reported together
                failures.append(f"{operation.method.upper()} {operation.path} as {who}: {str(exc)[:800]}")
    reached = tally["reached"]
    unreached = sorted({f"{o.method.upper()} {o.path}" for o in operations} - set(reached))
    summary = (
        f"{tally['cases']} cases, {len(operations)} operations, {len(reached)} reached past 401/403, "
        f"{tally['refused_writes']} refused writes with every table's row count unchanged"
    )
    print(summary)
    assert not failures, summary + "\n" + "\n\n".join(failures)
    assert not unreached, f"{summary}; never past the door: {unreached}"
