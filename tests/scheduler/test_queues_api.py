"""Queues through the API (docs/queues.md): operators set a tenant's queue with a strict
body (every problem listed, nothing written), see every tenant's; a tenant's people see
their own, with what they use, borrow and lend; the usage job decays and adds the
cards above nominal."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.core.clock import utcnow
from apps.scheduler import quotas
from apps.tenants.models import Cohort, TenantQueue
from tests.factories import make_node, make_task_holding
from tests.headers import bearer

pytestmark = pytest.mark.django_db

BODY = {"cohort": "research", "weight": 2.0, "quotas": [{"gpu_type": "nvidia", "nominal": 2}]}


def put(api, world, slug, body):
    return api.put(f"/api/v1/admin/queues/{slug}", body, format="json", **bearer(world.operator_key))


def test_an_operator_sets_a_queue_and_every_tenant_is_listed(api, world):
    answer = put(api, world, "acme", BODY)
    assert answer.status_code == 200, answer.json()
    queue = answer.json()["queue"]
    assert queue["cohort"] == "research" and queue["weight"] == 2.0
    assert queue["types"] == [
        {
            "gpu_type": "nvidia",
            "nominal": 2,
            "used": 0,
            "borrowed": 0,
            "lent": 0,
            "borrowing_limit": None,
            "lending_limit": None,
        }
    ]
    listed = api.get("/api/v1/admin/queues", **bearer(world.operator_key)).json()["results"]
    assert {row["tenant"]: row["queue"] is not None for row in listed} == {"acme": True, "beta": False}
    assert Cohort.objects.filter(name="research").exists()
    # replaced whole: the quota not named any more is gone, no cohort any more
    answer = put(api, world, "acme", {"cohort": None, "quotas": [{"gpu_type": "ascend", "nominal": 4}]})
    assert [row["gpu_type"] for row in answer.json()["queue"]["types"]] == ["ascend"]
    assert answer.json()["queue"]["cohort"] is None and answer.json()["queue"]["weight"] == 1.0


def test_a_bad_body_lists_every_problem_and_writes_nothing(api, world):
    answer = put(
        api,
        world,
        "acme",
        {
            "cohort": "Not A Slug!",
            "weight": 0,
            "quotas": [{"gpu_type": "nvidia", "nominal": -1}, {"gpu_type": "quantum", "nominal": 1}],
            "colour": "blue",
        },
    )
    assert answer.status_code == 400
    problems = answer.json()["error"]["fields"]
    assert {"cohort", "weight", "quotas", "colour"} <= set(problems), problems
    duplicate = put(api, world, "acme", {"cohort": None, "quotas": [{"gpu_type": "nvidia", "nominal": 1}] * 2})
    assert duplicate.status_code == 400 and "more than once" in str(duplicate.json())
    assert not TenantQueue.objects.exists() and not Cohort.objects.exists()


def test_only_operators_set_queues_and_an_unknown_tenant_is_404(api, world):
    assert put(api, world, "nobody", BODY).status_code == 404
    member = bearer(world.keys["acme-admin"])
    assert api.put("/api/v1/admin/queues/acme", BODY, format="json", **member).status_code == 403
    assert api.get("/api/v1/admin/queues", **member).status_code == 403


def test_a_cohort_nominal_past_the_fleet_is_allowed_with_a_warning(api, world):
    make_node("q-node", gpus=2)
    assert put(api, world, "acme", BODY).json()["warnings"] == []
    answer = put(api, world, "beta", BODY | {"weight": 1.0})
    assert answer.status_code == 200
    assert answer.json()["warnings"] == [
        "The cohort research's nominal nvidia cards add up to 4, more than the 2 nvidia cards in the fleet: "
        "not every member gets its nominal at once."
    ]


def test_a_tenants_people_see_their_queue_use_borrowing_and_lending(api, world):
    node = make_node("q-node", gpus=4)
    put(api, world, "acme", BODY | {"quotas": [{"gpu_type": "nvidia", "nominal": 1}]})
    put(api, world, "beta", BODY | {"quotas": [{"gpu_type": "nvidia", "nominal": 3}]})
    for card in (0, 1):  # acme holds 2: 1 above its nominal, lent by beta
        make_task_holding(node, world.tenants["acme"], "running", card=card)
    mine = api.get("/api/v1/queue", **bearer(world.keys["acme-viewer"])).json()
    assert mine["tenant"] == "acme" and mine["queue"]["types"][0] | {} == {
        "gpu_type": "nvidia",
        "nominal": 1,
        "used": 2,
        "borrowed": 1,
        "lent": 0,
        "borrowing_limit": None,
        "lending_limit": None,
    }
    assert mine["pending_count"] == 0 and mine["pending"] == []
    theirs = api.get("/api/v1/queue", **bearer(world.keys["beta-member"])).json()["queue"]["types"][0]
    assert (theirs["used"], theirs["lent"]) == (0, 1)
    operator = bearer(world.operator_key)
    assert api.get("/api/v1/queue", **operator).status_code == 400
    assert api.get("/api/v1/queue?tenant=beta", **operator).json()["queue"]["types"][0]["lent"] == 1


def test_the_usage_job_adds_cards_above_nominal_and_decays_the_past(api, world, settings):
    settings.HETEROFLOW_FAIR_SHARE_HALF_LIFE_DAYS = 1.0
    node = make_node("q-node", gpus=4)
    put(api, world, "acme", BODY | {"quotas": [{"gpu_type": "nvidia", "nominal": 1}]})
    put(api, world, "beta", BODY | {"quotas": [{"gpu_type": "nvidia", "nominal": 3}]})
    for card in (0, 1, 2):  # acme: 2 above nominal
        make_task_holding(node, world.tenants["acme"], "running", card=card)
    start = utcnow()
    assert quotas.account_usage(start) == 2  # both queues; the first run starts the clock
    assert quotas.account_usage(start + timedelta(hours=1)) == 2
    acme = TenantQueue.objects.get(tenant=world.tenants["acme"])
    assert acme.usage_above_nominal == pytest.approx(2 * 3600)  # 2 cards for an hour, card-seconds
    assert TenantQueue.objects.get(tenant=world.tenants["beta"]).usage_above_nominal == 0
    # a day later, with nothing held above nominal any more: half of it is left
    book = quotas.queue_book(start + timedelta(hours=25), used={})
    assert book.history[world.tenants["acme"].pk] == pytest.approx(3600)
    view = api.get("/api/v1/queue", **bearer(world.keys["acme-member"])).json()["queue"]
    assert view["usage_above_nominal_gpu_hours"] == pytest.approx(2.0, rel=0.01)
    assert view["fair_share_place"] == 2 and view["fair_share_of"] == 2  # beta has used less


def test_removing_a_queue_frees_the_tenant(api, world):
    put(api, world, "acme", BODY)
    operator = bearer(world.operator_key)
    assert api.delete("/api/v1/admin/queues/acme", **operator).status_code == 204
    assert api.delete("/api/v1/admin/queues/acme", **operator).status_code == 404
    assert api.get("/api/v1/admin/queues/acme", **operator).json() == {"tenant": "acme", "queue": None}
