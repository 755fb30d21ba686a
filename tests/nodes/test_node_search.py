"""The node search (`?q=`, the API's and the portal's): what it matches, read from the
stored search column (migration nodes/0007) and, where PostgreSQL has pg_trgm, through
its trigram indexes."""

import pytest
from django.db import connection

from apps.nodes.models import Gpu, Node
from apps.nodes.selectors import NODE_SEARCH_SQL, like_escaped, node_list
from tests.factories import make_node
from tests.headers import bearer

pytestmark = pytest.mark.django_db


class Operator:
    is_operator, is_tenant, is_agent = True, False, False


def found(q: str) -> list[str]:
    return sorted(node_list(Operator(), q=q).values_list("id", flat=True))


@pytest.fixture
def fleet():
    make_node(
        "n-alpha",
        name="Alpha Box",
        ip="198.51.100.7",
        internal_ip="10.1.2.3",
        rack="r12",
        zone="z-east",
        region="cn-north",
        gpu_model="NVIDIA H100 80GB HBM3",
    )
    make_node("n-beta", 4, vendor="ascend", model="Ascend 910B", name="beta_50%", gpu_model="Ascend 910B")
    mixed = make_node("n-mixed", 2, model="NVIDIA A100 40GB", gpu_model="mixed")
    Gpu.objects.filter(node=mixed, index=1).update(model="NVIDIA L40S")


@pytest.mark.parametrize(
    "q,ids",
    [
        ("alpha box", ["n-alpha"]),  # name, any case
        ("N-ALP", ["n-alpha"]),  # id
        ("198.51.100", ["n-alpha"]),  # public address
        ("10.1.2", ["n-alpha"]),  # internal address
        ("r12", ["n-alpha"]),
        ("z-east", ["n-alpha"]),
        ("cn-north", ["n-alpha"]),
        ("h100", ["n-alpha"]),  # the node's GPU model
        ("910b", ["n-beta"]),
        ("l40s", ["n-mixed"]),  # a mixed node: one of its cards
        ("a100", ["n-mixed"]),
        ("n-", ["n-alpha", "n-beta", "n-mixed"]),
        ("50%", ["n-beta"]),  # LIKE's wildcards are matched as themselves
        ("b_ta", []),  # "_" is no wildcard: "beta" does not match
        ("_", ["n-beta"]),
        ("%", ["n-beta"]),
        ("boxn-alpha", []),  # never across two fields
        ("nomatch", []),
    ],
)
def test_the_search_matches_a_substring_of_each_searched_field(fleet, q, ids):
    assert found(q) == ids


def test_the_stored_search_text_follows_every_write(fleet):
    """Triggers on nodes keep it, so a write by any path (here raw SQL, as the
    heartbeat writes) is searchable at once."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE nodes SET ip = '203.0.113.9', rack = 'r99' WHERE id = 'n-alpha'")
    assert found("203.0.113") == found("r99") == ["n-alpha"] and found("198.51.100") == []
    Node.objects.filter(pk="n-beta").update(name="renamed")
    assert found("renamed") == ["n-beta"] and found("beta_50") == []


def test_a_search_never_finds_another_tenants_dedicated_node(fleet, world, api):
    Node.objects.filter(pk="n-beta").update(tenant=world.tenants["beta"])
    answer = api.get("/api/v1/nodes?q=n-", **bearer(world.keys["acme-viewer"]))
    assert sorted(node["id"] for node in answer.json()["results"]) == ["n-alpha", "n-mixed"]
    answer = api.get("/api/v1/nodes?q=910b", **bearer(world.keys["acme-viewer"]))
    assert answer.json()["results"] == []


def has_trigrams() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_trgm')")
        return cursor.fetchone()[0]


def test_a_search_reads_the_trigram_indexes_where_postgresql_has_them(fleet):
    """Where pg_trgm is installed (every packaged PostgreSQL; not the embedded pgserver),
    the plan of a selective search uses the index on the search column: if the
    selector's expression and the migration's index ever part, this fails."""
    if not has_trigrams():
        pytest.skip("this PostgreSQL has no pg_trgm (the embedded pgserver): the search reads the table")
    pattern = "%" + like_escaped("R12") + "%"
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN " + NODE_SEARCH_SQL, [pattern, pattern])
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "node_search_trgm" in plan, plan


def search_row_version(node_id: str):
    with connection.cursor() as cursor:
        cursor.execute("SELECT ctid::text, text FROM node_search WHERE node_id = %s", [node_id])
        return cursor.fetchone()


def test_a_steady_beat_leaves_the_search_row_alone_and_a_delete_removes_it(fleet):
    """The heartbeat rewrites the node row every 5 s; the search row (and its trigram
    index) is written only when a searched field really changes (a rewrite moves the row:
    its ctid changes, even inside the test's one transaction)."""
    before = search_row_version("n-alpha")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE nodes SET last_heartbeat_at = now(), cpu_used = 50, ip = ip, name = name WHERE id = 'n-alpha'"
        )
    assert search_row_version("n-alpha") == before
    Node.objects.filter(pk="n-alpha").update(zone="z-west")
    assert search_row_version("n-alpha") != before and "Z-WEST" in search_row_version("n-alpha")[1]
    Gpu.objects.filter(node_id="n-alpha").delete()
    Node.objects.filter(pk="n-alpha").delete()
    assert search_row_version("n-alpha") is None and found("alpha") == []
