"""The GPU health API and its services: operators' cordon and uncordon of one card (bad
input writes nothing), the clean period, the cards by risk, the per-model prediction
("not enough data" below the minimum, a fraction above it), the capability matrix and
one card's history, scoped as the nodes are."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertState, AlertType, Severity
from apps.core.clock import utcnow
from apps.core.guard import Outcome
from apps.core.models import OperatorAuditEvent
from apps.nodes import gpu_health_services
from apps.nodes.jobs import gpu_health_recovery_job
from apps.nodes.models import Gpu
from apps.nodes.prediction import wilson_interval
from tests.factories import make_alert, make_node
from tests.headers import AGENT, bearer
from tests.nodes.health_readings import make_health_sample, nvidia_reading, partial_reading

pytestmark = pytest.mark.django_db


def health_cordon(node_id: str, index: int, *, bad_hours_ago: float, reason: str = "unhealthy: Xid 79"):
    """A card as the judgement leaves it: cordoned for its health, with its alert."""
    now = utcnow()
    bad_at = now - timedelta(hours=bad_hours_ago)
    Gpu.objects.filter(node_id=node_id, index=index).update(
        cordoned_at=bad_at,
        cordon_source="health",
        cordon_reason=reason,
        cordon_evidence={"reasons": [{"kind": "xid", "code": 79}]},
        last_bad_at=bad_at,
        health=nvidia_reading(index),
        health_at=bad_at,
    )
    return make_alert(
        type=AlertType.GPU_UNHEALTHY,
        severity=Severity.ERROR,
        scope=AlertScope.GPU,
        key=alert_keys.gpu_unhealthy(node_id, index),
        node_id=node_id,
        gpu_index=index,
    )


def audit_rows() -> int:
    return OperatorAuditEvent.objects.count()


# --- cordon and uncordon ------------------------------------------------------------------------


def test_an_operator_cordons_a_card_and_uncordons_it_with_the_alert_recovered(api, world):
    make_node("hc-1", gpus=2)
    url = "/api/v1/admin/nodes/hc-1/gpus/1/cordon"
    response = api.post(url, {"reason": "fan noise"}, format="json", **bearer(world.operator_key))
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["card"]["cordoned"] is True and body["card"]["cordon_source"] == "operator"
    assert [g["cordoned"] for g in body["node"]["gpus"]] == [False, True]
    assert body["node"]["gpus"][1]["cordon_reason"] == "fan noise" and body["node"]["gpus"][1]["state"] == "cordoned"
    gpu = Gpu.objects.get(node_id="hc-1", index=1)
    assert (gpu.cordon_source, gpu.cordon_reason) == ("operator", "fan noise")
    assert gpu.cordon_evidence["by"].startswith("op (key ")  # who, as the audit log names them
    event = OperatorAuditEvent.objects.get(action="gpu.cordon")
    assert (event.target, event.details) == ("hc-1/gpu/1", {"reason": "fan noise"})

    alert = make_alert(type=AlertType.GPU_UNHEALTHY, key=alert_keys.gpu_unhealthy("hc-1", 1), node_id="hc-1")
    response = api.post("/api/v1/admin/nodes/hc-1/gpus/1/uncordon", {}, format="json", **bearer(world.operator_key))
    assert response.status_code == 200, response.content
    assert response.json()["card"]["cordoned"] is False
    gpu.refresh_from_db()
    assert (gpu.cordoned_at, gpu.cordon_source, gpu.cordon_reason, gpu.cordon_evidence) == (None, "", "", {})
    alert.refresh_from_db()
    assert alert.state == AlertState.RECOVERED and alert.ended_at is not None
    assert OperatorAuditEvent.objects.get(action="gpu.uncordon").details["alert_recovered"] is True


def test_uncordon_lifts_a_health_cordon_and_recovers_its_alert(world):
    node = make_node("hc-2", gpus=1)
    alert = health_cordon("hc-2", 0, bad_hours_ago=1)
    gpu_health_services.uncordon_card(node, 0, None)
    alert.refresh_from_db()
    assert alert.state == AlertState.RECOVERED
    gpu = Gpu.objects.get(node_id="hc-2", index=0)
    assert gpu.cordoned_at is None and gpu.last_bad_at is not None  # the history stays


@pytest.mark.parametrize(
    "who, path, body, status",
    [
        ("operator", "/api/v1/admin/nodes/nope/gpus/0/cordon", {"reason": "x"}, 404),
        ("operator", "/api/v1/admin/nodes/hc-3/gpus/7/cordon", {"reason": "x"}, 404),
        ("operator", "/api/v1/admin/nodes/hc-3/gpus/0/cordon", {}, 400),
        ("operator", "/api/v1/admin/nodes/hc-3/gpus/0/cordon", {"reason": "   "}, 400),
        ("operator", "/api/v1/admin/nodes/hc-3/gpus/0/cordon", {"reason": "x", "force": True}, 400),
        ("operator", "/api/v1/admin/nodes/hc-3/gpus/0/cordon", {"reason": "x" * 301}, 400),
        ("operator", "/api/v1/admin/nodes/hc-3/gpus/1/cordon", {"reason": "x"}, 409),  # already cordoned
        ("operator", "/api/v1/admin/nodes/hc-3/gpus/0/uncordon", {}, 409),  # not cordoned
        ("operator", "/api/v1/admin/nodes/hc-3/gpus/7/uncordon", {}, 404),
        ("acme-admin", "/api/v1/admin/nodes/hc-3/gpus/0/cordon", {"reason": "x"}, 403),
        ("acme-admin", "/api/v1/admin/nodes/hc-3/gpus/1/uncordon", {}, 403),
        ("acme-viewer", "/api/v1/admin/nodes/hc-3/gpus/1/uncordon", {}, 403),
    ],
)
def test_bad_input_and_refusals_write_nothing(api, world, who, path, body, status):
    make_node("hc-3", gpus=2)
    alert = health_cordon("hc-3", 1, bad_hours_ago=1)
    before = list(Gpu.objects.filter(node_id="hc-3").order_by("index").values())
    audits = audit_rows()
    key = world.operator_key if who == "operator" else world.keys[who]
    response = api.post(path, body, format="json", **bearer(key))
    assert response.status_code == status, response.content
    assert list(Gpu.objects.filter(node_id="hc-3").order_by("index").values()) == before
    assert audit_rows() == audits
    alert.refresh_from_db()
    assert alert.state == AlertState.ACTIVE


def test_a_tenant_cannot_reach_another_tenants_dedicated_card(api, world):
    make_node("hc-4", gpus=1, tenant=world.tenants["beta"])
    for path in ("/api/v1/nodes/hc-4/gpus/0/health",):
        assert api.get(path, **bearer(world.keys["acme-admin"])).status_code == 404
    assert api.get("/api/v1/nodes/hc-4/gpus/0/health", **bearer(world.keys["beta-viewer"])).status_code == 200


# --- the clean period ------------------------------------------------------------------------------


def test_the_clean_period_uncordons_only_when_configured_and_clean(world, settings):
    make_node("hc-5", gpus=6)
    clean = health_cordon("hc-5", 0, bad_hours_ago=30)
    recent = health_cordon("hc-5", 1, bad_hours_ago=2)
    health_cordon("hc-5", 2, bad_hours_ago=30)
    Gpu.objects.filter(node_id="hc-5", index=2).update(lost_at=utcnow())  # not reporting
    health_cordon("hc-5", 3, bad_hours_ago=30)
    Gpu.objects.filter(node_id="hc-5", index=3).update(health=nvidia_reading(3, remapped_rows_failure=True))
    Gpu.objects.filter(node_id="hc-5", index=4).update(
        cordoned_at=utcnow() - timedelta(days=9), cordon_source="operator", cordon_reason="by hand"
    )

    settings.HETEROFLOW_GPU_HEALTH_CLEAN_HOURS = 0
    assert gpu_health_services.recover_clean_cards().uncordoned == []
    assert Gpu.objects.filter(node_id="hc-5", cordoned_at__isnull=False).count() == 5

    settings.HETEROFLOW_GPU_HEALTH_CLEAN_HOURS = 24
    done = gpu_health_services.recover_clean_cards()
    assert done.uncordoned == [("hc-5", 0)] and done.alerts_recovered == 1
    clean.refresh_from_db()
    recent.refresh_from_db()
    assert clean.state == AlertState.RECOVERED and recent.state == AlertState.ACTIVE
    assert list(Gpu.objects.filter(node_id="hc-5", cordoned_at__isnull=False).values_list("index", flat=True)) == [
        1,
        2,
        3,
        4,
    ]
    event = OperatorAuditEvent.objects.get(action="gpu.uncordon")
    assert (event.actor, event.target) == ("system", "hc-5/gpu/0")
    assert gpu_health_services.recover_clean_cards().uncordoned == []  # once


def test_the_clean_period_waits_for_a_silent_node(world, settings):
    make_node("hc-6", gpus=1, last_heartbeat_at=utcnow() - timedelta(hours=3))
    health_cordon("hc-6", 0, bad_hours_ago=30)
    settings.HETEROFLOW_GPU_HEALTH_CLEAN_HOURS = 24
    assert gpu_health_services.recover_clean_cards().uncordoned == []


def test_the_recovery_job_runs_under_the_guard(world, settings):
    settings.HETEROFLOW_GPU_HEALTH_CLEAN_HOURS = 24
    make_node("hc-7", gpus=1)
    health_cordon("hc-7", 0, bad_hours_ago=48)
    assert gpu_health_recovery_job(immediate=True) == Outcome.RAN
    assert Gpu.objects.get(node_id="hc-7", index=0).cordoned_at is None


# --- the cards by risk ------------------------------------------------------------------------------


def test_cards_by_risk_cordoned_first_then_evidence_then_the_rest_scoped_and_paged(api, world):
    make_node("hr-1", gpus=4)
    make_node("hr-2", gpus=1, tenant=world.tenants["beta"])
    now = utcnow()
    Gpu.objects.filter(node_id="hr-1", index=0).update(health=nvidia_reading(0), health_at=now)
    Gpu.objects.filter(node_id="hr-1", index=1).update(
        health=nvidia_reading(1, retired_pages_pending=True, ecc_corrected_aggregate=3), health_at=now
    )
    Gpu.objects.filter(node_id="hr-1", index=2).update(
        health=nvidia_reading(2, ecc_corrected_aggregate=9), health_at=now
    )  # corrected, rising since its previous sample
    make_health_sample("hr-1", 2, now - timedelta(hours=1), ecc_corrected_aggregate=4)
    make_health_sample("hr-1", 2, now, ecc_corrected_aggregate=9)
    health_cordon("hr-1", 3, bad_hours_ago=1)
    health_cordon("hr-2", 0, bad_hours_ago=1)

    body = api.get("/api/v1/gpu-health", **bearer(world.operator_key)).json()
    assert body["count"] == 5
    order = [(c["node_id"], c["index"], c["risk"]) for c in body["results"]]
    assert order[:2] == [("hr-1", 3, "cordoned"), ("hr-2", 0, "cordoned")]
    assert order[2:] == [("hr-1", 2, "evidence"), ("hr-1", 1, "evidence"), ("hr-1", 0, "none")]
    by_card = {(c["node_id"], c["index"]): c for c in body["results"]}
    assert [e["code"] for e in by_card["hr-1", 1]["evidence"]] == ["retirement_pending", "corrected_ecc"]
    assert [e["code"] for e in by_card["hr-1", 2]["evidence"]] == ["corrected_rising"]
    assert by_card["hr-1", 3]["cordon_reason"] == "unhealthy: Xid 79" and by_card["hr-1", 3]["state"] == "cordoned"
    assert by_card["hr-1", 0]["prediction"]["status"] == "not_applicable"

    acme = api.get("/api/v1/gpu-health", **bearer(world.keys["acme-viewer"])).json()
    assert [c["node_id"] for c in acme["results"]] == ["hr-1"] * 4  # beta's dedicated node is not acme's
    page = api.get("/api/v1/gpu-health", {"limit": 2, "offset": 2}, **bearer(world.operator_key)).json()
    assert [(c["node_id"], c["index"]) for c in page["results"]] == [("hr-1", 2), ("hr-1", 1)]
    only = api.get("/api/v1/gpu-health", {"risk": "cordoned"}, **bearer(world.operator_key)).json()
    assert only["count"] == 2
    assert api.get("/api/v1/gpu-health", {"risk": "bad"}, **bearer(world.operator_key)).status_code == 400
    assert api.get("/api/v1/gpu-health", {"limit": 0}, **bearer(world.operator_key)).status_code == 400


def test_a_card_without_health_shows_nulls_not_zeros(api, world):
    make_node("hr-3", gpus=1)
    [card] = api.get("/api/v1/gpu-health", **bearer(world.operator_key)).json()["results"]
    assert (card["health"], card["health_at"], card["risk"], card["evidence"]) == (None, None, "none", [])
    assert card["prediction"]["status"] == "no_data"
    [gpu] = api.get("/api/v1/nodes/hr-3", **bearer(world.operator_key)).json()["gpus"]
    assert (gpu["cordoned"], gpu["cordon_reason"], gpu["health"]) == (False, "", None)


def test_the_node_detail_carries_each_cards_health_summary(api, world):
    make_node("hr-4", gpus=1)
    health_cordon("hr-4", 0, bad_hours_ago=1)
    Gpu.objects.filter(node_id="hr-4").update(
        health=partial_reading(0, {"ecc_uncorrected_aggregate": 2, "remapped_rows_pending": True})
    )
    [gpu] = api.get("/api/v1/nodes/hr-4", **bearer(world.operator_key)).json()["gpus"]
    assert gpu["cordoned"] is True and gpu["cordon_reason"] == "unhealthy: Xid 79"
    summary = gpu["health"]
    assert (summary["ecc_uncorrected"], summary["ecc_corrected"], summary["pending"]) == (2, None, True)
    assert summary["last_bad_at"].endswith("Z") and summary["remapped_rows_failure"] is False


# --- one card's history ---------------------------------------------------------------------------


def test_a_cards_history_newest_first(api, world):
    make_node("hh-1", gpus=1)
    now = utcnow()
    for hours, corrected in ((3, 1), (2, 2), (1, 5)):
        make_health_sample("hh-1", 0, now - timedelta(hours=hours), ecc_corrected_aggregate=corrected)
    make_health_sample("hh-1", 1, now, ecc_corrected_aggregate=99)  # another card's
    body = api.get("/api/v1/nodes/hh-1/gpus/0/health", {"limit": 2}, **bearer(world.operator_key)).json()
    assert body["count"] == 3 and body["card"]["index"] == 0
    assert [s["ecc_corrected_aggregate"] for s in body["results"]] == [5, 2]
    assert body["results"][0]["ecc_uncorrected_aggregate"] is None  # not read: null, not 0
    assert api.get("/api/v1/nodes/hh-1/gpus/4/health", **bearer(world.operator_key)).status_code == 404
    assert api.get("/api/v1/nodes/nope/gpus/0/health", **bearer(world.operator_key)).status_code == 404


# --- failure prediction ---------------------------------------------------------------------------


def history(model: str, cards: int, failing: int, *, prefix: str, unhealthy_first: int = 0):
    """`cards` cards of `model` seen with corrected errors, `failing` of them judged
    unhealthy later; `unhealthy_first` more that were unhealthy before any corrected error."""
    start = utcnow() - timedelta(days=30)
    for i in range(cards + unhealthy_first):
        node_id = f"{prefix}-{i}"
        if i >= cards:
            make_health_sample(node_id, 0, start, model=model, unhealthy=True, ecc_uncorrected_aggregate=1)
            make_health_sample(node_id, 0, start + timedelta(days=1), model=model, ecc_corrected_aggregate=3)
            continue
        make_health_sample(node_id, 0, start, model=model, ecc_corrected_aggregate=0)
        make_health_sample(node_id, 0, start + timedelta(days=1), model=model, ecc_corrected_aggregate=2)
        if i < failing:
            make_health_sample(
                node_id, 0, start + timedelta(days=5), model=model, ecc_corrected_aggregate=9, unhealthy=True
            )


def test_prediction_says_not_enough_data_below_the_minimum_and_a_fraction_above(api, world, settings):
    settings.HETEROFLOW_GPU_HEALTH_PREDICTION_MIN_CARDS = 30
    history("H100", 40, 10, prefix="p-h100", unhealthy_first=3)
    history("A100", 29, 20, prefix="p-a100")
    make_health_sample("p-l40", 0, utcnow(), model="L40S")  # observed, never a corrected error
    body = api.get("/api/v1/gpu-health/predictions", **bearer(world.operator_key)).json()
    assert body["min_cards"] == 30 and "not been checked against real failure data" in body["caveat"]
    models = {m["model"]: m for m in body["models"]}
    h100 = models["H100"]
    assert (h100["cards_observed"], h100["cards_with_corrected"], h100["became_unhealthy"]) == (43, 40, 10)
    assert h100["status"] == "estimate" and h100["failure_fraction"] == pytest.approx(0.25)
    low, high = wilson_interval(10, 40)
    assert (h100["interval_low"], h100["interval_high"]) == (pytest.approx(low), pytest.approx(high))
    assert 0.14 < low < 0.25 < high < 0.41
    a100 = models["A100"]
    assert (a100["cards_with_corrected"], a100["became_unhealthy"], a100["status"]) == (29, 20, "not_enough_data")
    assert (a100["failure_fraction"], a100["interval_low"], a100["interval_high"]) == (None, None, None)
    assert models["L40S"]["cards_with_corrected"] == 0 and models["L40S"]["status"] == "not_enough_data"


def test_a_card_with_corrected_errors_gets_its_models_figure_only_with_enough_data(api, world, settings):
    settings.HETEROFLOW_GPU_HEALTH_PREDICTION_MIN_CARDS = 5
    history("H100", 5, 1, prefix="q-h100")
    history("A100", 4, 4, prefix="q-a100")
    make_node("hq-1", gpus=1, model="H100")
    make_node("hq-2", gpus=1, model="A100")
    for node_id in ("hq-1", "hq-2"):
        Gpu.objects.filter(node_id=node_id).update(
            health=nvidia_reading(0, ecc_corrected_volatile=3), health_at=utcnow()
        )
    cards = {c["node_id"]: c for c in api.get("/api/v1/gpu-health", **bearer(world.operator_key)).json()["results"]}
    assert cards["hq-1"]["prediction"]["status"] == "estimate"
    assert cards["hq-1"]["prediction"]["failure_fraction"] == pytest.approx(0.2)
    assert cards["hq-2"]["prediction"] == {
        "status": "not_enough_data",
        "failure_fraction": None,
        "interval": None,
        "cards_with_corrected": 4,
        "became_unhealthy": 4,
    }


def test_wilson_interval_bounds():
    assert wilson_interval(0, 0) is None
    low, high = wilson_interval(0, 30)
    assert low == 0.0 and 0.1 < high < 0.12
    low, high = wilson_interval(30, 30)
    assert high == pytest.approx(1.0) and 0.88 < low < 0.9


# --- the capability matrix ------------------------------------------------------------------------


def test_the_capability_matrix_says_what_each_vendor_declared(api, world):
    make_node("hm-1", gpus=2)
    make_node("hm-2", gpus=1, vendor="ascend", model="Ascend 910B")
    make_node("hm-3", gpus=1, vendor="hygon", model="DCU Z100")  # cards, none reporting
    now = utcnow()
    Gpu.objects.filter(node_id="hm-1").update(health=nvidia_reading(0), health_at=now)
    Gpu.objects.filter(node_id="hm-2").update(
        health=partial_reading(0, {"ecc_corrected_aggregate": 0, "ecc_uncorrected_aggregate": 0}), health_at=now
    )
    body = api.get("/api/v1/gpu-health/capabilities", **bearer(world.operator_key)).json()
    vendors = {v["vendor"]: v for v in body["vendors"]}
    assert body["fields"][0] == "ecc_mode" and "xid_events" in body["fields"]
    nvidia = vendors["nvidia"]
    assert (nvidia["cards"], nvidia["reporting_cards"], nvidia["status"]) == (2, 2, "reports")
    assert set(nvidia["fields"].values()) == {2}
    ascend = vendors["ascend"]
    assert ascend["fields"]["ecc_uncorrected_aggregate"] == 1 and ascend["fields"]["xid_events"] == 0
    assert (vendors["hygon"]["status"], vendors["hygon"]["fields"]) == ("no_reporting_card", None)
    assert (vendors["kunlun"]["status"], vendors["kunlun"]["cards"]) == ("no_cards", 0)


def test_the_read_endpoints_take_people_not_the_agent(api, world):
    for path in ("/api/v1/gpu-health", "/api/v1/gpu-health/predictions", "/api/v1/gpu-health/capabilities"):
        assert api.get(path).status_code == 401
        assert api.get(path, **AGENT).status_code == 403
        assert api.get(path, **bearer(world.keys["acme-viewer"])).status_code == 200
