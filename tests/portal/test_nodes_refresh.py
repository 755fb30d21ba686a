"""The nodes page's agent versions and its refresh: each card names the agent's version
and commit (a "-dirty" build flagged), a panel counts the versions the visible nodes run
and flags a mismatch, and GET /portal/node-cards/ answers the page's parts for the same
query string, each card rendered as the page renders it, scoped as the page is."""

import json
import re

import pytest

from apps.nodes.models import Node
from apps.scheduler.services import run_cycle
from apps.tasks import services as task_services
from tests.portal.client import page, signed_in
from tests.portal.nodes import add_node

pytestmark = pytest.mark.django_db

URL = "/portal/node-cards/"


def agent(node_id: str, version: str, commit: str) -> None:
    """The node as its heartbeat leaves it: the agent's version and commit stored."""
    Node.objects.filter(pk=node_id).update(agent_version=version, agent_git_commit=commit)


@pytest.fixture
def fleet(cluster):
    """alpha and bravo on 2.4.1 (bravo a dirty build of it), charlie (tenant beta's) on
    2.5.0, delta (offline) never reported a version."""
    agent("shared-1", "2.4.1", "9f1c2ab")
    agent("shared-2", "2.4.1", "9f1c2ab-dirty")
    agent("beta-1", "2.5.0", "0d1e2f3")
    return cluster


def card(html: str, node_id: str) -> str:
    found = re.search(rf'<a class="node-card" href="[^"]+" data-node="{re.escape(node_id)}".*?</a>\n', html, re.S)
    assert found, f"no card for {node_id}"
    return found.group(0)


def squeezed(html: str) -> str:
    return re.sub(r"\s+", " ", html).strip()


def cards_json(client, query="", status=200):
    response = client.get(URL + query)
    assert response.status_code == status
    assert response["Content-Type"] == "application/json"
    return response.json()


def test_a_card_names_the_agents_version_and_commit_and_flags_a_dirty_build(client, world, fleet):
    html = page(signed_in(client, world.operator), "/portal/nodes/")
    alpha, bravo, delta = card(html, "shared-1"), card(html, "shared-2"), card(html, "shared-3")
    assert "<span data-agent-version>2.4.1</span>" in alpha and "<code data-agent-commit>9f1c2ab</code>" in alpha
    assert "data-agent-dirty" not in alpha
    assert "<code data-agent-commit>9f1c2ab-dirty</code>" in bravo and ">dirty build</span>" in bravo
    assert "agent version not reported" in delta and "data-agent-version" not in delta


def fleet_rows(html: str) -> dict:
    section = re.search(r'<section class="card agent-fleet".*?</section>', html, re.S).group(0)
    return {
        version: int(nodes)
        for version, nodes in re.findall(r'<tr data-agent-version="([^"]*)">.*?data-fleet-nodes>(\d+)<', section, re.S)
    }


def test_the_fleet_panel_counts_the_versions_and_flags_a_mismatch_within_what_the_user_sees(client, world, fleet):
    operator = page(signed_in(client, world.operator), "/portal/nodes/")
    assert fleet_rows(operator) == {"2.4.1": 2, "2.5.0": 1, "": 1}  # most nodes first, "not reported" last
    assert "data-fleet-mismatch>mismatch: 2 versions in use</span>" in operator
    assert "1 node runs an agent built from a source tree with uncommitted changes" in operator
    # tenant acme does not see beta's dedicated node: one version among its nodes
    member = page(signed_in(client, world.users["acme-member"]), "/portal/nodes/")
    assert fleet_rows(member) == {"2.4.1": 2, "": 1}
    assert "data-fleet-mismatch" not in member and "data-fleet-uniform>one version<" in member


def test_a_node_that_never_reported_a_version_makes_no_mismatch(client, world, cluster):
    agent("shared-1", "2.4.1", "9f1c2ab")
    html = page(signed_in(client, world.operator), "/portal/nodes/")
    assert fleet_rows(html) == {"2.4.1": 1, "": 3}
    assert "data-fleet-mismatch" not in html and "data-fleet-dirty" not in html


def test_no_nodes_no_versions(client, world):
    html = page(signed_in(client, world.operator), "/portal/nodes/")
    assert "No node has registered yet." in html and fleet_rows(html) == {}
    body = cards_json(client)
    assert body["nodes"] == [] and body["fleet"] == {
        "versions": [],
        "reported_versions": 0,
        "mismatch": False,
        "dirty_nodes": 0,
    }


def test_the_refresh_answers_the_pages_parts_as_the_page_renders_them(client, world, fleet):
    task = task_services.create_task(tenant=world.tenants["acme"], name="t", image="busybox", gpu_required=2)
    assert run_cycle().bound == [task.pk]
    signed_in(client, world.operator)
    html = page(client, "/portal/nodes/?sort=name")
    body = cards_json(client, "?sort=name")
    assert [node["id"] for node in body["nodes"]] == ["shared-1", "shared-2", "beta-1", "shared-3"]
    for node in body["nodes"]:  # the same rendering as the page's
        assert squeezed(node["html"]) == squeezed(card(html, node["id"]))
    bravo = body["nodes"][1]
    assert (bravo["agent_version"], bravo["agent_git_commit"], bravo["agent_dirty"]) == ("2.4.1", "9f1c2ab-dirty", True)
    assert body["summary"] == {"total": 9, "busy": 2, "idle": 6, "lost": 1, "placed": 1, "unplaced": 0, "rate": 100.0}
    assert body["fleet"]["mismatch"] is True and body["fleet"]["dirty_nodes"] == 1
    assert [row["version"] for row in body["fleet"]["versions"]] == ["2.4.1", "2.5.0", ""]
    assert body["fleet"]["versions"][0]["commits"] == [
        {"commit": "9f1c2ab", "nodes": 1, "dirty": False},
        {"commit": "9f1c2ab-dirty", "nodes": 1, "dirty": True},
    ]
    assert [row["alive"] for row in body["fleet"]["versions"]] == [2, 1, 0]  # delta is offline
    assert body["page"] == {"number": 1, "pages": 1, "count": 4}
    assert 'data-summary="busy">2<' in body["html"]["strip"]
    assert "mismatch: 2 versions in use" in body["html"]["fleet"]
    assert body["html"]["pagination"].strip() == '<p class="muted pagination">4 in all</p>'
    assert body["refresh_seconds"] == 30 and body["at"]
    # what the page gives its script: where to read, how often
    config = json.loads(re.search(r'<script id="nodes-refresh" type="application/json">(.*?)</script>', html).group(1))
    assert config == {"url": URL, "seconds": 30}


def test_the_refresh_keeps_the_search_order_and_page_of_the_query(client, world, fleet):
    signed_in(client, world.operator)
    assert [node["id"] for node in cards_json(client, "?q=r12")["nodes"]] == ["shared-1"]  # rack
    assert cards_json(client, "?q=nomatch")["nodes"] == []
    # an order the page does not offer is its default (most tasks first, then by name)
    by_default = cards_json(client, "?sort=bogus")["nodes"]
    assert [node["id"] for node in by_default] == ["shared-1", "shared-2", "beta-1", "shared-3"]
    for n in range(30):
        add_node(f"extra-{n:02d}", name=f"extra-{n:02d}", gpus=0)
    first = cards_json(client, "?sort=name")
    assert first["page"] == {"number": 1, "pages": 2, "count": 34} and len(first["nodes"]) == 24
    second = cards_json(client, "?sort=name&page=2")
    assert second["page"]["number"] == 2 and len(second["nodes"]) == 10
    assert not {n["id"] for n in first["nodes"]} & {n["id"] for n in second["nodes"]}
    assert 'href="?page=1&amp;sort=name" rel="prev"' in second["html"]["pagination"]  # the filters kept
    assert cards_json(client, "?sort=name&page=99")["page"]["number"] == 2  # past the end: the last page


def test_the_refresh_is_scoped_as_the_page_and_signed_in_only(client, world, fleet):
    member = signed_in(client, world.users["acme-viewer"])
    body = cards_json(member, "?sort=name")
    assert [node["id"] for node in body["nodes"]] == ["shared-1", "shared-2", "shared-3"]  # not beta's node
    assert "2.5.0" not in json.dumps(body)
    assert body["summary"]["total"] == 7
    response = member.get(URL)
    assert "no-cache" in response["Cache-Control"] and "no-store" in response["Cache-Control"]
    assert member.post(URL).status_code == 405
    client.logout()
    anonymous = client.get(URL)
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/portal/login/?next=")
