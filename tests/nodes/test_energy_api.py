"""GET /api/v1/nodes/{id}/energy (accumulators, window, power series, daily energy,
carbon under the factor and role rules) and the operators' factor and node energy
endpoints (docs/energy.md). The heartbeat fills the accumulators; here they are set as
it leaves them."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db import connection

from apps.core.clock import utcnow
from apps.core.models import OperatorAuditEvent
from apps.nodes import carbon
from apps.nodes.models import EmissionFactor, EnergyDaily, Gpu, Node
from tests.factories import make_node
from tests.headers import bearer

pytestmark = pytest.mark.django_db


def energy_of(api, key, node_id, query="hours=1"):
    response = api.get(f"/api/v1/nodes/{node_id}/energy?{query}", **bearer(key))
    assert response.status_code == 200, response.content
    return response.json()


def insert_metrics(node_id, samples):
    with connection.cursor() as cursor:
        for at, cpu, gpus in samples:
            cursor.execute(
                "INSERT INTO node_metrics (node_id, at, cpu_used, memory_used, gpus) "
                "VALUES (%s, %s, %s, %s, %s::jsonb)",
                [node_id, at, cpu, 50.0, json.dumps(gpus)],
            )


def measured(node_id, index, wh, *, gap=0.0, since=None, power=300.0):
    now = utcnow()
    Gpu.objects.filter(node_id=node_id, index=index).update(
        energy_wh=wh, energy_since=since or now - timedelta(days=3), power_at=now, power_w=power, energy_gap_seconds=gap
    )


# --- no data: null, never 0 ---------------------------------------------------------------------


def test_a_node_that_never_measured_power_answers_null_everywhere(api, world):
    make_node("quiet", gpus=2, region="eu-north")
    EmissionFactor.objects.create(region="eu-north", g_co2e_per_kwh=40)
    answer = energy_of(api, world.operator_key, "quiet", "hours=24&days=3")
    assert answer["gpu_energy_kwh"] is None and answer["gpu_power_avg_w"] is None
    assert answer["samples_with_power"] == 0 and answer["cpu_energy_kwh_estimate"] is None
    lifetime = answer["lifetime"]
    assert lifetime["gpu_energy_kwh"] is None and lifetime["since"] is None and lifetime["gap_seconds"] is None
    assert [card["energy_kwh"] for card in lifetime["gpus"]] == [None, None]
    assert [card["gap_seconds"] for card in lifetime["gpus"]] == [None, None]
    cpu = lifetime["cpu_estimate"]
    assert cpu["estimate"] is True and cpu["energy_kwh"] is None and cpu["tdp_w"] is None
    assert answer["series"]["points"] == [] and answer["series"]["cpu_estimate"] is True
    assert len(answer["daily"]) == 3 and all(day["gpu_kwh"] is None for day in answer["daily"])
    assert all(day["cpu_kwh_estimate"] is None for day in answer["daily"])
    # a factor covers it, but there is nothing to convert: no figure, and no 0 either
    assert answer["carbon"]["basis"] == "no_data" and answer["carbon"]["lifetime_gpu_g"] is None
    assert answer["carbon"]["factor_g_per_kwh"] == 40


def test_the_accumulators_the_window_the_series_and_the_days(api, world):
    node = make_node("busy", gpus=2, cpu_tdp_w_model=250.0)
    measured("busy", 0, 12_000.0, gap=30.0)
    measured("busy", 1, 3_000.0, gap=5.0)
    Node.objects.filter(pk="busy").update(
        cpu_energy_wh_estimate=2_500.0, cpu_power_w_estimate=160.0, cpu_power_at=utcnow()
    )
    now = utcnow()
    insert_metrics(
        "busy",
        [
            (now - timedelta(seconds=5 * i), 40.0, [{"i": 0, "p": 400.0}, {"i": 1, "p": 200.0}, {"i": 2, "u": 1}])
            for i in range(13)
        ],
    )
    today = now.date()
    EnergyDaily.objects.bulk_create(
        [
            EnergyDaily(node_id="busy", gpu_index=0, day=today, wh=1_000.0, meter_wh=12_000.0),
            EnergyDaily(node_id="busy", gpu_index=1, day=today, wh=500.0, meter_wh=3_000.0),
            EnergyDaily(node_id="busy", gpu_index=-1, day=today, wh=300.0, meter_wh=2_500.0),
            EnergyDaily(node_id="busy", gpu_index=0, day=today - timedelta(days=2), wh=800.0, meter_wh=11_000.0),
        ]
    )
    answer = energy_of(api, world.operator_key, node.pk, "hours=1&days=3")
    lifetime = answer["lifetime"]
    assert lifetime["gpu_energy_kwh"] == pytest.approx(15.0) and lifetime["gap_seconds"] == 35.0
    assert [(c["index"], c["energy_kwh"]) for c in lifetime["gpus"]] == [(0, 12.0), (1, 3.0)]
    assert lifetime["cpu_estimate"] | {"at": None} == {
        "estimate": True,
        "energy_kwh": 2.5,
        "power_w": 160.0,
        "at": None,
        "tdp_w": 250.0,
        "tdp_source": "model",
    }
    # the window: 12 spans of 5 s at 600 W measured; the CPU estimate at 40 % of 250 W
    assert answer["gpu_energy_kwh"] == pytest.approx(600 * 60 / 3_600_000)
    cpu_watts = 250.0 * (0.3 + 0.7 * 0.4)
    assert answer["cpu_energy_kwh_estimate"] == pytest.approx(cpu_watts * 60 / 3_600_000)
    points = answer["series"]["points"]
    assert points and all(p["gpu_power_w"] == pytest.approx(600.0) for p in points)
    assert all(p["cpu_power_w_estimate"] == pytest.approx(cpu_watts) for p in points)
    # per card, only the cards that reported power (card 2 sent utilisation alone)
    assert all([(g["index"], g["power_w"]) for g in p["gpus"]] == [(0, 400.0), (1, 200.0)] for p in points)
    days = {day["day"]: day for day in answer["daily"]}
    assert days[today.isoformat()]["gpu_kwh"] == pytest.approx(1.5)
    assert days[today.isoformat()]["cpu_kwh_estimate"] == pytest.approx(0.3)
    assert [g["index"] for g in days[today.isoformat()]["gpus"]] == [0, 1]
    assert days[(today - timedelta(days=1)).isoformat()]["gpu_kwh"] is None  # no row: no data, not 0
    assert days[(today - timedelta(days=2)).isoformat()]["gpu_kwh"] == pytest.approx(0.8)
    # no factor anywhere: no absolute figure, and the operator is told how to set one
    assert answer["carbon"]["basis"] == "no_factor" and answer["carbon"]["lifetime_gpu_g"] is None
    assert "PUT /api/v1/admin/emission-factors/" in answer["carbon"]["configure"]


def test_an_operator_tdp_wins_over_the_model_table_and_none_means_no_estimate(api, world):
    make_node("tdp", gpus=1, cpu_tdp_w_model=200.0)
    insert_metrics("tdp", [(utcnow() - timedelta(seconds=5 * i), 100.0, []) for i in range(3)])
    assert energy_of(api, world.operator_key, "tdp")["series"]["points"][-1]["cpu_power_w_estimate"] == 200.0
    Node.objects.filter(pk="tdp").update(cpu_tdp_w=300.0)
    answer = energy_of(api, world.operator_key, "tdp")
    assert answer["lifetime"]["cpu_estimate"]["tdp_source"] == "operator"
    assert answer["series"]["points"][-1]["cpu_power_w_estimate"] == 300.0
    Node.objects.filter(pk="tdp").update(cpu_tdp_w=None, cpu_tdp_w_model=None)
    answer = energy_of(api, world.operator_key, "tdp")
    assert answer["series"]["points"][-1]["cpu_power_w_estimate"] is None
    assert answer["cpu_energy_kwh_estimate"] is None


def test_the_query_is_bounded(api, world):
    make_node("q", gpus=1)
    for query in ("hours=0", "hours=169", "days=0", "days=367", "what=1"):
        assert api.get(f"/api/v1/nodes/q/energy?{query}", **bearer(world.operator_key)).status_code == 400


# --- carbon: the factor -------------------------------------------------------------------------


def test_the_node_factor_overrides_the_region_factor_and_none_gives_no_figure(api, world):
    make_node("f", gpus=1, region="eu-west")
    measured("f", 0, 2_000.0)  # 2 kWh
    answer = energy_of(api, world.operator_key, "f")
    assert answer["carbon"]["basis"] == "no_factor" and answer["carbon"]["factor_g_per_kwh"] is None
    EmissionFactor.objects.create(region="eu-west", g_co2e_per_kwh=250.0, source="grid operator 2026")
    answer = energy_of(api, world.operator_key, "f")["carbon"]
    assert (answer["basis"], answer["factor_source"], answer["factor_g_per_kwh"]) == ("factor", "region", 250.0)
    assert answer["lifetime_gpu_g"] == pytest.approx(500.0) and "configure" not in answer
    Node.objects.filter(pk="f").update(emission_factor_g_per_kwh=20.0)
    answer = energy_of(api, world.operator_key, "f")["carbon"]
    assert (answer["factor_source"], answer["lifetime_gpu_g"]) == ("node", pytest.approx(40.0))
    # a factor of 0 (a certified supply) is a factor: 0 g is then a figure, not "no data"
    Node.objects.filter(pk="f").update(emission_factor_g_per_kwh=0.0)
    assert energy_of(api, world.operator_key, "f")["carbon"]["lifetime_gpu_g"] == 0.0


def test_factor_for_reads_the_same_rule_as_the_sql():
    node = make_node("rule", gpus=0, region="r1")
    assert carbon.factor_for(node) is None
    EmissionFactor.objects.create(region="r1", g_co2e_per_kwh=100.0)
    assert carbon.factor_for(node) == carbon.Factor(100.0, "region", "r1")
    node.emission_factor_g_per_kwh = 7.0
    assert carbon.factor_for(node).source == "node"
    Node.objects.filter(pk="rule").update(emission_factor_g_per_kwh=7.0)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {carbon.factor_sql()} FROM nodes AS n {carbon.region_factor_join()} WHERE n.id IN ('rule')"
        )
        assert cursor.fetchone()[0] == 7.0
    # a node with no region is not covered by a factor named "" (region_factor_join)
    EmissionFactor.objects.create(region="", g_co2e_per_kwh=1.0)
    assert carbon.factor_for(make_node("nowhere", gpus=0)) is None


# --- carbon: the role rule ----------------------------------------------------------------------


def test_who_sees_node_carbon(api, world):
    acme = world.tenants["acme"]
    make_node("acme-box", gpus=1, tenant=acme, emission_factor_g_per_kwh=500.0)
    make_node("shared-box", gpus=1, emission_factor_g_per_kwh=500.0)
    for node_id in ("acme-box", "shared-box"):
        measured(node_id, 0, 1_000.0)

    def seen(key, node_id):
        return energy_of(api, key, node_id)["carbon"]

    for node_id in ("acme-box", "shared-box"):  # operators: every node, with the factor
        assert seen(world.operator_key, node_id)["lifetime_gpu_g"] == pytest.approx(500.0)
    admin = seen(world.keys["acme-admin"], "acme-box")  # the tenant's admin: its dedicated node
    assert (admin["basis"], admin["lifetime_gpu_g"], admin["factor_g_per_kwh"]) == ("factor", 500.0, 500.0)
    for label in ("acme-member", "acme-viewer"):  # members and viewers: no node figure
        hidden = seen(world.keys[label], "acme-box")
        assert hidden["basis"] == "not_visible" and hidden["lifetime_gpu_g"] is None
        assert hidden["factor_g_per_kwh"] is None
    shared = seen(world.keys["acme-admin"], "shared-box")  # other tenants' work is in a shared node's
    assert shared["basis"] == "not_visible" and shared["lifetime_gpu_g"] is None
    # the energy itself is not hidden: it is what the node used
    assert energy_of(api, world.keys["acme-member"], "acme-box")["lifetime"]["gpu_energy_kwh"] == 1.0
    assert api.get("/api/v1/nodes/acme-box/energy", **bearer(world.keys["beta-admin"])).status_code == 404


# --- the operators' endpoints -------------------------------------------------------------------


def put(api, key, url, body):
    return api.put(url, data=json.dumps(body), content_type="application/json", **bearer(key))


def test_operators_manage_the_regions_factors_with_audit_records(api, world):
    make_node("in-region", gpus=0, region="eu-north")
    url = "/api/v1/admin/emission-factors/eu-north"
    created = put(api, world.operator_key, url, {"g_co2e_per_kwh": 30.5, "source": "Nord Pool 2026"})
    assert created.status_code == 201 and created.json()["nodes"] == 1
    assert put(api, world.operator_key, url, {"g_co2e_per_kwh": 31}).status_code == 200
    listed = api.get("/api/v1/admin/emission-factors", **bearer(world.operator_key)).json()
    assert [(f["region"], f["g_co2e_per_kwh"], f["source"]) for f in listed] == [("eu-north", 31.0, "")]
    assert api.get(url, **bearer(world.operator_key)).json()["g_co2e_per_kwh"] == 31.0
    events = list(OperatorAuditEvent.objects.filter(target="eu-north").order_by("id"))
    assert [e.action for e in events] == ["emission_factor.set", "emission_factor.set"]
    assert events[1].details["before"] == {"g_co2e_per_kwh": 30.5, "source": "Nord Pool 2026"}
    assert api.delete(url, **bearer(world.operator_key)).status_code == 204
    assert api.get(url, **bearer(world.operator_key)).status_code == 404
    assert api.delete(url, **bearer(world.operator_key)).status_code == 404
    assert OperatorAuditEvent.objects.filter(target="eu-north", action="emission_factor.deleted").count() == 1
    for label in ("acme-admin", "acme-member"):
        assert put(api, world.keys[label], url, {"g_co2e_per_kwh": 1}).status_code == 403
        assert api.get("/api/v1/admin/emission-factors", **bearer(world.keys[label])).status_code == 403
    assert not EmissionFactor.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        {"g_co2e_per_kwh": -1},
        {"g_co2e_per_kwh": "NaN"},
        {"g_co2e_per_kwh": "Infinity"},
        {"g_co2e_per_kwh": 2000.5},
        {"g_co2e_per_kwh": True},
        {"g_co2e_per_kwh": None},
        {},
        {"g_co2e_per_kwh": 100, "unit": "kg"},
        {"g_co2e_per_kwh": 100, "source": "x" * 201},
    ],
)
def test_a_bad_factor_is_refused_and_nothing_is_written(api, world, body):
    EmissionFactor.objects.create(region="eu", g_co2e_per_kwh=100.0, source="kept")
    assert put(api, world.operator_key, "/api/v1/admin/emission-factors/eu", body).status_code == 400
    assert put(api, world.operator_key, "/api/v1/admin/emission-factors/new", body).status_code == 400
    assert list(EmissionFactor.objects.values_list("region", "g_co2e_per_kwh", "source")) == [("eu", 100.0, "kept")]
    assert not OperatorAuditEvent.objects.filter(action__startswith="emission_factor").exists()


def test_a_nan_literal_in_the_body_is_refused(api, world):
    response = api.put(
        "/api/v1/admin/emission-factors/eu",
        data='{"g_co2e_per_kwh": NaN}',
        content_type="application/json",
        **bearer(world.operator_key),
    )
    assert response.status_code == 400 and not EmissionFactor.objects.exists()


def test_a_region_longer_than_a_node_region_is_refused(api, world):
    assert (
        put(api, world.operator_key, f"/api/v1/admin/emission-factors/{'r' * 65}", {"g_co2e_per_kwh": 1}).status_code
        == 400
    )
    assert not EmissionFactor.objects.exists()


def test_operators_set_a_nodes_factor_and_tdp(api, world):
    acme = world.tenants["acme"]
    make_node("own", gpus=0, region="eu", tenant=acme)
    url = "/api/v1/admin/nodes/own/energy"
    answer = put(api, world.operator_key, url, {"emission_factor_g_per_kwh": 12.5, "cpu_tdp_w": 350})
    assert answer.status_code == 200
    assert answer.json() | {"cpu_tdp_w_model": None} == {
        "node_id": "own",
        "emission_factor_g_per_kwh": 12.5,
        "cpu_tdp_w": 350.0,
        "cpu_tdp_w_model": None,
        "region": "eu",
        "factor_g_per_kwh": 12.5,
        "factor_source": "node",
    }
    # omitted: unchanged; null: cleared (the region's factor covers it again, when there is one)
    answer = put(api, world.operator_key, url, {"emission_factor_g_per_kwh": None}).json()
    assert answer["emission_factor_g_per_kwh"] is None and answer["cpu_tdp_w"] == 350.0
    assert answer["factor_source"] is None
    node = Node.objects.get(pk="own")
    assert (node.emission_factor_g_per_kwh, node.cpu_tdp_w) == (None, 350.0)
    events = OperatorAuditEvent.objects.filter(target="own", action="node.energy_settings").order_by("id")
    assert [e.details["after"] for e in events] == [
        {"emission_factor_g_per_kwh": 12.5, "cpu_tdp_w": 350.0},
        {"emission_factor_g_per_kwh": None},
    ]
    assert events[1].details["before"] == {"emission_factor_g_per_kwh": 12.5} and events[0].tenant == "acme"
    assert put(api, world.keys["acme-admin"], url, {"cpu_tdp_w": 100}).status_code == 403
    assert api.get(url, **bearer(world.operator_key)).json()["cpu_tdp_w"] == 350.0


@pytest.mark.parametrize(
    "body",
    [
        {"emission_factor_g_per_kwh": -0.1, "cpu_tdp_w": 200},
        {"emission_factor_g_per_kwh": 2001, "cpu_tdp_w": 200},
        {"emission_factor_g_per_kwh": "nan", "cpu_tdp_w": 200},
        {"emission_factor_g_per_kwh": 10, "cpu_tdp_w": 2001},
        {"emission_factor_g_per_kwh": 10, "cpu_tdp_w": 0},
        {"emission_factor_g_per_kwh": 10, "cpu_tdp_w": -5},
        {"emission_factor_g_per_kwh": 10, "cpu_tdp_w": "Infinity"},
        {"emission_factor_g_per_kwh": 10, "rack": "r1"},
    ],
)
def test_bad_node_energy_settings_write_nothing(api, world, body):
    make_node("strict", gpus=0, emission_factor_g_per_kwh=50.0, cpu_tdp_w=100.0)
    assert put(api, world.operator_key, "/api/v1/admin/nodes/strict/energy", body).status_code == 400
    node = Node.objects.get(pk="strict")
    assert (node.emission_factor_g_per_kwh, node.cpu_tdp_w, node.rack) == (50.0, 100.0, "")
    assert not OperatorAuditEvent.objects.filter(target="strict").exists()


def test_the_admin_saves_and_deletes_factors_through_the_services(client, world):
    client.force_login(world.operator)
    assert client.get("/admin/nodes/emissionfactor/").status_code == 200
    refused = client.post("/admin/nodes/emissionfactor/add/", {"region": "eu", "g_co2e_per_kwh": "2500", "source": ""})
    assert refused.status_code == 200 and b"between 0 and 2000" in refused.content
    assert not EmissionFactor.objects.exists()
    added = client.post("/admin/nodes/emissionfactor/add/", {"region": "eu", "g_co2e_per_kwh": "45", "source": "x"})
    assert added.status_code == 302
    factor = EmissionFactor.objects.get(region="eu")
    assert OperatorAuditEvent.objects.filter(target="eu", action="emission_factor.set", actor="op").count() == 1
    assert client.post(f"/admin/nodes/emissionfactor/{factor.pk}/delete/", {"post": "yes"}).status_code == 302
    assert not EmissionFactor.objects.exists()
    assert OperatorAuditEvent.objects.filter(target="eu", action="emission_factor.deleted").count() == 1
