"""Shared fixtures. Tenants are real: each has its own PostgreSQL schema."""

from __future__ import annotations

import pytest
from django.db import transaction
from rest_framework.test import APIClient

from tests import flush
from tests.factories import build_world
from tests.nodes.agents import Agents

PASSWORD = "pw-for-tests-only"
flush.install()


@pytest.fixture(scope="module")
def world(django_db_setup, django_db_blocker):
    """Built once per module inside a transaction that is rolled back afterwards; each
    test runs in a savepoint inside it (like Django's setUpTestData)."""
    with django_db_blocker.unblock():
        atomic = transaction.atomic()
        atomic.__enter__()
        try:
            yield build_world()
        finally:
            transaction.set_rollback(True)
            atomic.__exit__(None, None, None)


@pytest.fixture
def api():
    return APIClient()


@pytest.fixture
def agents():
    """Heartbeats through the real ASGI route (tests/nodes/agents.py)."""
    agents = Agents()
    yield agents
    agents.close()
