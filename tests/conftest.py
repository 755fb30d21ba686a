"""Shared fixtures. Tenants are real: each has its own PostgreSQL schema."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from django.db import transaction
from rest_framework.test import APIClient

from apps.tenants import services
from apps.tenants.choices import Role
from tests import flush
from tests.factories import OperatorFactory, UserFactory
from tests.nodes.agents import Agents

PASSWORD = "pw-for-tests-only"
flush.install()


@dataclass
class World:
    """Two tenants with an admin, a member and a viewer each, an operator, and keys."""

    operator: object = None
    operator_key: str = ""
    tenants: dict = field(default_factory=dict)
    users: dict = field(default_factory=dict)  # "acme-admin" -> user
    keys: dict = field(default_factory=dict)  # "acme-admin" -> plaintext key


def build_world() -> World:
    world = World()
    world.operator = OperatorFactory(username="op")
    world.operator_key = services.issue_platform_key(user=world.operator, name="ops").key
    for slug in ("acme", "beta"):
        tenant = services.create_tenant(name=slug.capitalize(), slug=slug)
        world.tenants[slug] = tenant
        for role in (Role.ADMIN, Role.MEMBER, Role.VIEWER):
            label = f"{slug}-{role}"
            user = UserFactory(username=label)
            services.add_member(tenant, username=user.username, role=role)
            world.users[label] = user
            from apps.core.principals import Principal, PrincipalKind

            owner = Principal(PrincipalKind.TENANT_USER, user=user, tenant=tenant, role=role)
            world.keys[label] = services.issue_tenant_key(principal=owner, tenant=tenant, owner=user, name=label).key
    return world


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
