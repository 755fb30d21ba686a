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
from hypothesis import HealthCheck, given, settings
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
    """Thousands of refused requests would each log a warning."""
    logger = logging.getLogger("django.request")
    level, logger.level = logger.level, logging.ERROR
    yield
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


def fuzzer(operation, who: str, headers: dict, tally: dict):
    """The Hypothesis test of one operation as one principal; counts into `tally`."""
    label = f"{operation.method.upper()} {operation.path}"

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    def fuzz(case):
        tally["cases"] += 1
        response = case.call_and_validate(headers=headers, checks=CHECKS)
        if response.status_code not in (401, 403):
            tally["reached"].setdefault(label, set()).add(who)
        if operation.path not in PUBLIC:
            wrong = case.call(headers=WRONG_KEY)
            assert wrong.status_code == 401, f"wrong credentials answered {wrong.status_code}"

    return fuzz


def test_every_operation_answers_by_its_schema_for_every_principal(world, keep_connection, quiet):
    from django.core.wsgi import get_wsgi_application

    schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 50, "the schema lost its operations"
    tally, failures = {"cases": 0, "reached": {}}, []
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
    summary = f"{tally['cases']} cases, {len(operations)} operations, {len(reached)} reached past 401/403"
    print(summary)
    assert not failures, summary + "\n" + "\n\n".join(failures)
    assert not unreached, f"{summary}; never past the door: {unreached}"
