"""The slices' read API: GET /api/v1/slices (scoped, filtered, paged) and
/api/v1/slices/{id}, and the node detail's per-GPU slices (another tenant's slice shows
only carved memory)."""

from __future__ import annotations

import pytest

from tests.factories import make_bound_slice, make_node, make_slice
from tests.headers import AGENT, bearer

pytestmark = pytest.mark.django_db

LIST = "/api/v1/slices"


@pytest.fixture
def carved(world):
    node = make_node("shared-node", 2, model="NVIDIA H200", memory_total_mb=143771)
    acme, beta = world.tenants["acme"], world.tenants["beta"]
    return {
        "acme_mig": make_bound_slice(node, acme, state="confirmed", device_id="MIG-acme", handles={"gi": 1, "ci": 0}),
        "acme_sw": make_bound_slice(node, acme, card=1, state="confirmed", tier="software", profile="", memory_mb=8192),
        "beta_mig": make_bound_slice(node, beta, state="requested", profile="2g.35gb", memory_mb=35 * 1024),
        "orphan": make_slice(node, None, gpu_index=1, state="orphaned", device_id="MIG-lost"),
        "released": make_slice(node, acme, gpu_index=1, state="released"),
        "node": node,
    }


def ids(answer) -> set[int]:
    return {row["id"] for row in answer.json()["results"]}


def test_an_operator_lists_every_slice_and_a_tenant_its_own(api, world, carved):
    everything = api.get(LIST, **bearer(world.operator_key))
    assert everything.status_code == 200, everything.content
    body = everything.json()
    assert body["count"] == 5 and {"next", "previous", "results"} <= set(body)
    acme = api.get(LIST, **bearer(world.keys["acme-viewer"]))
    assert ids(acme) == {carved[k].pk for k in ("acme_mig", "acme_sw", "released")}
    beta = api.get(LIST, **bearer(world.keys["beta-member"]))
    assert ids(beta) == {carved["beta_mig"].pk}
    row = next(r for r in acme.json()["results"] if r["id"] == carved["acme_mig"].pk)
    assert row["tier"] == "mig" and row["qos"] == "gold" and row["tenant"] == "acme"
    assert row["task_id"] == carved["acme_mig"].task_id and row["device_id"] == "MIG-acme"
    software = next(r for r in acme.json()["results"] if r["id"] == carved["acme_sw"].pk)
    assert software["qos"] == "bronze"


def test_the_filters_and_the_paging(api, world, carved):
    op = bearer(world.operator_key)
    assert ids(api.get(LIST, {"state": "orphaned"}, **op)) == {carved["orphan"].pk}
    assert ids(api.get(LIST, {"tier": "software"}, **op)) == {carved["acme_sw"].pk}
    assert ids(api.get(LIST, {"task_id": carved["beta_mig"].task_id}, **op)) == {carved["beta_mig"].pk}
    assert api.get(LIST, {"node_id": "elsewhere"}, **op).json()["count"] == 0
    assert api.get(LIST, {"node_id": "shared-node"}, **op).json()["count"] == 5
    page = api.get(LIST, {"limit": 2, "offset": 1}, **op).json()
    assert page["count"] == 5 and len(page["results"]) == 2
    for bad in ({"state": "melted"}, {"tier": "magic"}, {"task_id": "x"}, {"bogus": "1"}, {"limit": 0}):
        answer = api.get(LIST, bad, **op)
        assert answer.status_code == 400 and set(answer.json()["error"]["fields"]) == set(bad)


def test_one_slice_by_id_and_another_tenants_is_404(api, world, carved):
    mine = api.get(f"{LIST}/{carved['acme_mig'].pk}", **bearer(world.keys["acme-member"]))
    assert mine.status_code == 200 and mine.json()["profile"] == "1g.18gb"
    theirs = api.get(f"{LIST}/{carved['beta_mig'].pk}", **bearer(world.keys["acme-member"]))
    assert theirs.status_code == 404
    assert api.get(f"{LIST}/{carved['orphan'].pk}", **bearer(world.keys["acme-admin"])).status_code == 404
    assert api.get(f"{LIST}/{carved['orphan'].pk}", **bearer(world.operator_key)).status_code == 200


def test_the_agent_key_reads_no_slices(api, carved):
    assert api.get(LIST, **AGENT).status_code == 403


def test_the_node_detail_shows_each_cards_slices_and_only_the_callers_details(api, world, carved):
    url = "/api/v1/nodes/shared-node"
    op = api.get(url, **bearer(world.operator_key)).json()
    card0, card1 = op["gpus"]
    assert [s["id"] for s in card0["slices"]] == [carved["acme_mig"].pk, carved["beta_mig"].pk]
    assert {s["id"] for s in card1["slices"]} == {carved["acme_sw"].pk, carved["orphan"].pk}  # released: gone
    assert card0["slices"][1]["tenant"] == "beta" and card0["slices"][1]["own"] is True
    acme = api.get(url, **bearer(world.keys["acme-viewer"])).json()
    mine, theirs = acme["gpus"][0]["slices"]
    assert mine == {
        "id": carved["acme_mig"].pk,
        "tier": "mig",
        "qos": "gold",
        "state": "confirmed",
        "memory_mb": 18 * 1024,
        "compute_percent": 14,
        "profile": "1g.18gb",
        "tenant": "acme",
        "task_id": carved["acme_mig"].task_id,
        "task_name": "sliced-confirmed",
        "own": True,
    }
    assert theirs["own"] is False and theirs["memory_mb"] == 35 * 1024 and theirs["tier"] == "mig"
    assert theirs["id"] is None and theirs["tenant"] is None and theirs["task_id"] is None
    assert theirs["task_name"] is None
    assert "beta" not in str(acme["gpus"][0]["slices"])
