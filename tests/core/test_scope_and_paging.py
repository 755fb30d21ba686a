"""The scoped base view, the shared policy and the one paging convention (issue 14,
point 3): these fail if a view or a page grows its own scoped lookup, its own copy of a
rule, or its own paging again."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command

from apps.core.pagination import MAX_LIMIT
from apps.core.principals import Principal, PrincipalKind
from apps.core.views import ScopedAPIView, get_visible_or_404
from apps.nodes.models import Node
from apps.tasks.models import Task
from apps.tenants import policy
from apps.tenants.choices import Role

APPS = Path(__file__).resolve().parents[2] / "apps"
SOURCES = sorted(path for path in APPS.rglob("*.py") if "migrations" not in path.parts)
AGENT = {"HTTP_X_API_KEY": settings.HETEROFLOW_AGENT_SECRET}


def key(value: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {value}"}


def where(pattern: str, allowed: set[str]) -> list[str]:
    found = []
    for path in SOURCES:
        name = str(path.relative_to(APPS.parent))
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line) and name not in allowed:
                found.append(f"{name}:{number}: {line.strip()}")
    return found


# --- one place for each thing --------------------------------------------------------------


def test_no_view_or_page_declares_its_own_scoped_lookup():
    helpers = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("visible_") and node.name != "visible_to":
                helpers.append(f"{path.relative_to(APPS.parent)}:{node.lineno} {node.name}")
    assert helpers == [], "look rows up with apps.core.views (ScopedAPIView, get_visible_or_404)"
    assert where(r"get_object_or_404\(.*visible_to\(", {"apps/core/views.py"}) == []


def test_role_rules_are_written_only_in_the_policy():
    # Principal.has_tenant_role is the primitive; who may do what with it is apps.tenants.policy
    assert where(r"has_tenant_role\(", {"apps/core/principals.py", "apps/tenants/policy.py"}) == []
    assert where(r"can delete nodes|cannot stop tasks|cannot create tasks", {"apps/tenants/policy.py"}) == []
    assert where(r"No tenant '", {"apps/tenants/policy.py"}) == []


def test_one_paginator_and_no_page_numbers():
    assert settings.REST_FRAMEWORK["DEFAULT_PAGINATION_CLASS"] == "apps.core.pagination.Pagination"
    assert where(r"PageNumberPagination|LimitOffsetPagination|page_size", {"apps/core/pagination.py"}) == []


# --- the base view ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_get_visible_or_404_answers_404_outside_scope_as_for_a_missing_row(world):
    from django.http import Http404

    Node.objects.create(id="acme-only", name="acme-only", tenant=world.tenants["acme"])
    acme = Principal(
        PrincipalKind.TENANT_USER, user=world.users["acme-viewer"], tenant=world.tenants["acme"], role=Role.VIEWER
    )
    beta = Principal(
        PrincipalKind.TENANT_USER, user=world.users["beta-admin"], tenant=world.tenants["beta"], role=Role.ADMIN
    )
    assert get_visible_or_404(Node, acme, pk="acme-only").pk == "acme-only"
    assert get_visible_or_404(Node.objects.only("id"), acme, pk="acme-only").pk == "acme-only"
    for principal, pk in ((beta, "acme-only"), (acme, "no-such-node"), (None, "acme-only")):
        with pytest.raises(Http404):
            get_visible_or_404(Node, principal, pk=pk)


def test_the_scoped_base_view_fails_closed_before_a_request():
    class Nodes(ScopedAPIView):
        queryset = Node.objects.all()

    assert Nodes().get_queryset().query.is_empty()


# --- the policy -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_policy_says_who_may_delete_a_node_and_stop_a_task(world):
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    dedicated, shared = Node(id="d", tenant=acme), Node(id="s")
    task = Task(tenant=acme)

    def who(label):
        slug, role = label.split("-")
        return Principal(PrincipalKind.TENANT_KEY, user=world.users[label], tenant=world.tenants[slug], role=Role(role))

    operator = Principal(PrincipalKind.OPERATOR, user=world.operator)
    assert [
        policy.may_delete_node(p, dedicated)
        for p in (operator, who("acme-admin"), who("acme-member"), who("beta-admin"))
    ] == [True, True, False, False]
    assert [policy.may_delete_node(p, shared) for p in (operator, who("acme-admin"))] == [True, False]
    assert [
        policy.may_stop_task(p, task) for p in (operator, who("acme-member"), who("acme-viewer"), who("beta-admin"))
    ] == [True, True, False, False]
    assert policy.acting_tenant(who("beta-member"), None, required="x") == beta
    assert policy.acting_tenant(operator, "acme", required="x") == acme


# --- the paging convention over the wire ------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/tenants",
        "/api/v1/tasks",
        "/api/v1/alerts",
        "/api/v1/nodes",
        "/api/v1/api-keys",
        "/api/v1/alerts/channels",
    ],
)
def test_every_list_pages_by_limit_and_offset_with_a_count(api, world, path):
    first = api.get(path, {"limit": 1}, **key(world.operator_key))
    assert first.status_code == 200, first.content
    body = first.json()
    assert set(body) == {"count", "next", "previous", "results"} and len(body["results"]) <= 1
    for bad in ({"limit": 0}, {"limit": MAX_LIMIT + 1}, {"limit": "many"}, {"offset": -1}):
        refused = api.get(path, bad, **key(world.operator_key))
        assert refused.status_code == 400 and next(iter(bad)) in str(refused.json()), (path, bad)


@pytest.mark.django_db
def test_a_page_of_tenants_by_limit_and_offset(api, world):
    page = api.get("/api/v1/tenants", {"limit": 1, "offset": 1}, **key(world.operator_key)).json()
    assert page["count"] == 2 and [t["slug"] for t in page["results"]] == ["beta"]
    assert page["next"] is None and page["previous"].endswith("limit=1")
    assert api.get("/api/v1/tenants", {"offset": 10}, **key(world.operator_key)).json()["results"] == []


@pytest.mark.django_db
def test_the_agent_channel_keeps_its_own_limit(api, world):
    assert api.get("/api/v1/tasks", {"node_id": "n", "status": "scheduled", "limit": 100}, **AGENT).status_code == 200
    refused = api.get("/api/v1/tasks", {"node_id": "n", "status": "scheduled", "limit": 101}, **AGENT)
    assert refused.status_code == 400 and "limit" in str(refused.json())


def test_the_schema_describes_every_list_as_limit_offset_pages(tmp_path):
    out = tmp_path / "schema.json"
    call_command("spectacular", "--format", "openapi-json", "--file", str(out))
    schema = json.loads(out.read_text())
    lists = 0
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            names = {p["name"] for p in operation.get("parameters", [])}
            assert not names & {"page", "page_size"}, (method, path)
            ok = operation.get("responses", {}).get("200", {}).get("content", {}).get("application/json", {})
            ref = ok.get("schema", {}).get("$ref", "")
            if ref.startswith("#/components/schemas/Paginated"):
                lists += 1
                assert {"limit", "offset"} <= names, (method, path)
                page = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
                assert {"count", "next", "previous", "results"} <= set(page["properties"]), ref
    assert lists >= 10
