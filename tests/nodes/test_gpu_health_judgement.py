"""The health judgement: heartbeats with `gpu_health` through the real ASGI route and a
real PostgreSQL (the route has its own pool, so the data is committed: transactional
tests), and the pure `judge`."""

from __future__ import annotations

import pytest

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertType
from apps.alerts.models import Alert
from apps.alerts.notifications.dispatch import dispatch_notifications
from apps.nodes.health import judge
from apps.nodes.models import Gpu, GpuHealthSample, Node
from tests.nodes.health_readings import nvidia_reading, xid
from tests.nodes.payloads import heartbeat as payload

FATAL = (48, 62, 64, 74, 79, 92, 94, 95, 119, 120)


# --- judge, pure ------------------------------------------------------------------------------


def test_a_healthy_reading_is_no_reason():
    assert judge(None, nvidia_reading(0), FATAL) == []
    assert judge(nvidia_reading(0), nvidia_reading(0, ecc_corrected_volatile=7, ecc_corrected_aggregate=9), FATAL) == []


def test_uncorrected_errors_on_first_sight_and_growth_are_reasons_with_before_and_after():
    first = judge(None, nvidia_reading(0, ecc_uncorrected_aggregate=2), FATAL)
    assert [(r["field"], r["before"], r["after"]) for r in first] == [("ecc_uncorrected_aggregate", None, 2)]
    grown = judge(nvidia_reading(0, ecc_uncorrected_volatile=1), nvidia_reading(0, ecc_uncorrected_volatile=3), FATAL)
    assert grown[0] | {"message": ""} == {
        "kind": "counter",
        "field": "ecc_uncorrected_volatile",
        "before": 1,
        "after": 3,
        "message": "",
    }
    assert "1 → 3" in grown[0]["message"]
    # an unchanged count is not new evidence; a volatile count reset by a driver reload neither
    assert (
        judge(nvidia_reading(0, ecc_uncorrected_aggregate=2), nvidia_reading(0, ecc_uncorrected_aggregate=2), FATAL)
        == []
    )
    assert (
        judge(nvidia_reading(0, ecc_uncorrected_volatile=4), nvidia_reading(0, ecc_uncorrected_volatile=0), FATAL) == []
    )


def test_retirements_and_remaps_count_when_they_grow_and_a_remap_failure_when_it_appears():
    before = nvidia_reading(0, retired_pages_double_bit=1, remapped_rows_uncorrectable=1)
    assert judge(None, before, FATAL) == []  # on first sight only uncorrected ECC counts
    after = nvidia_reading(0, retired_pages_double_bit=2, remapped_rows_uncorrectable=3, remapped_rows_failure=True)
    assert [r["field"] for r in judge(before, after, FATAL)] == [
        "retired_pages_double_bit",
        "remapped_rows_uncorrectable",
        "remapped_rows_failure",
    ]
    assert judge(after, after | {"ecc_corrected_volatile": 1}, FATAL) == []  # still failed: not new


def test_only_a_new_fatal_xid_is_a_reason():
    old = xid(79, "2026-12-01T10:00:00Z", "GPU has fallen off the bus")
    reasons = judge(nvidia_reading(0), nvidia_reading(0, xid_events=[old]), FATAL)
    assert reasons == [
        {
            "kind": "xid",
            "code": 79,
            "text": "GPU has fallen off the bus",
            "at": "2026-12-01T10:00:00Z",
            "message": "Xid 79 (GPU has fallen off the bus) at 2026-12-01T10:00:00Z",
        }
    ]
    assert judge(nvidia_reading(0, xid_events=[old]), nvidia_reading(0, xid_events=[old]), FATAL) == []
    assert judge(nvidia_reading(0), nvidia_reading(0, xid_events=[xid(13, "2026-12-01T10:00:00Z")]), FATAL) == []
    assert judge(nvidia_reading(0), nvidia_reading(0, xid_events=[old]), fatal_xids=()) == []


def test_an_xid_re_dated_a_second_off_by_an_agent_restart_is_the_same_event():
    # the agent dates kernel-log records from its own boot-time estimate, to the second
    old = xid(79, "2026-12-01T10:00:00Z", "GPU has fallen off the bus")
    re_dated = xid(79, "2026-12-01T10:00:01Z", "GPU has fallen off the bus")
    assert judge(nvidia_reading(0, xid_events=[old]), nvidia_reading(0, xid_events=[re_dated]), FATAL) == []
    later = xid(79, "2026-12-01T10:05:00Z", "GPU has fallen off the bus")
    assert [
        r["at"] for r in judge(nvidia_reading(0, xid_events=[old]), nvidia_reading(0, xid_events=[later]), FATAL)
    ] == ["2026-12-01T10:05:00Z"]


def test_an_absent_field_is_no_evidence():
    assert judge(None, {"index": 0, "available": []}, FATAL) == []
    assert judge(nvidia_reading(0, ecc_uncorrected_aggregate=3), {"index": 0, "available": []}, FATAL) == []


# --- through the heartbeat ----------------------------------------------------------------------

pytestmark_db = pytest.mark.django_db(transaction=True)


def beat(agents, node_id, *readings):
    response = agents.send(node_id, payload(gpus=2, gpu_health=list(readings)))
    assert response.status_code == 200, response.text
    return response


def card(node_id, index=0) -> Gpu:
    return Gpu.objects.get(node_id=node_id, index=index)


def unhealthy_alerts(node_id, index=0):
    return list(Alert.objects.filter(key=alert_keys.gpu_unhealthy(node_id, index)).order_by("id"))


@pytestmark_db
def test_a_card_with_uncorrected_errors_is_cordoned_with_the_alert_and_its_evidence(agents):
    beat(agents, "hx-1", nvidia_reading(0), nvidia_reading(1))
    assert card("hx-1").cordoned_at is None and GpuHealthSample.objects.filter(node_id="hx-1").count() == 2
    beat(agents, "hx-1", nvidia_reading(0, ecc_uncorrected_volatile=2, ecc_uncorrected_aggregate=2), nvidia_reading(1))
    gpu = card("hx-1")
    assert gpu.cordoned_at is not None and gpu.cordon_source == "health" and gpu.last_bad_at == gpu.cordoned_at
    assert "uncorrected ECC errors (volatile): 0 → 2" in gpu.cordon_reason
    assert [(r["field"], r["before"], r["after"]) for r in gpu.cordon_evidence["reasons"]] == [
        ("ecc_uncorrected_volatile", 0, 2),
        ("ecc_uncorrected_aggregate", 0, 2),
    ]
    assert gpu.state == "cordoned" and card("hx-1", 1).cordoned_at is None  # per card, not per node
    [alert] = unhealthy_alerts("hx-1")
    assert (alert.type, alert.severity, alert.scope, alert.state) == (AlertType.GPU_UNHEALTHY, "error", "gpu", "ACTIVE")
    assert alert.gpu_index == 0 and alert.details["reasons"][0]["after"] == 2
    assert alert.dispatched_raised_at is None
    assert dispatch_notifications().raised >= 1  # the outbox takes it from the table, as every alert
    alert.refresh_from_db()
    assert alert.dispatched_raised_at is not None
    sample = GpuHealthSample.objects.filter(node_id="hx-1", gpu_index=0).order_by("-at", "-id").first()
    assert sample.unhealthy and [r["field"] for r in sample.reasons] == [
        "ecc_uncorrected_volatile",
        "ecc_uncorrected_aggregate",
    ]
    assert sample.ecc_uncorrected_aggregate == 2


@pytestmark_db
def test_the_same_reading_again_changes_nothing(agents):
    bad = nvidia_reading(0, ecc_uncorrected_aggregate=1)
    beat(agents, "hx-2", bad, nvidia_reading(1))
    before = card("hx-2")
    samples = GpuHealthSample.objects.filter(node_id="hx-2").count()
    beat(agents, "hx-2", bad, nvidia_reading(1))
    after = card("hx-2")
    assert (after.cordoned_at, after.last_bad_at, after.cordon_evidence) == (
        before.cordoned_at,
        before.last_bad_at,
        before.cordon_evidence,
    )
    assert GpuHealthSample.objects.filter(node_id="hx-2").count() == samples
    assert len(unhealthy_alerts("hx-2")) == 1
    # the other card's reading changes: that card takes the step, this one is not judged again
    beat(agents, "hx-2", bad, nvidia_reading(1, ecc_corrected_volatile=1))
    assert card("hx-2").last_bad_at == before.last_bad_at
    assert GpuHealthSample.objects.filter(node_id="hx-2").count() == samples + 1


@pytestmark_db
def test_a_cordoned_card_keeps_its_first_cordon_while_new_evidence_updates_last_bad_at(agents):
    beat(agents, "hx-3", nvidia_reading(0, ecc_uncorrected_aggregate=1), nvidia_reading(1))
    first = card("hx-3")
    beat(agents, "hx-3", nvidia_reading(0, ecc_uncorrected_aggregate=4), nvidia_reading(1))
    again = card("hx-3")
    assert (again.cordoned_at, again.cordon_reason, again.cordon_source) == (
        first.cordoned_at,
        first.cordon_reason,
        "health",
    )
    assert again.last_bad_at > first.last_bad_at
    assert [(r["before"], r["after"]) for r in again.cordon_evidence["reasons"]] == [(None, 1), (1, 4)]
    assert again.cordon_evidence["first_at"] == first.cordon_evidence["first_at"]
    assert len(unhealthy_alerts("hx-3")) == 1  # still the one active alert


@pytestmark_db
def test_a_fatal_xid_cordons_and_a_non_fatal_one_does_not(agents):
    beat(agents, "hx-4", nvidia_reading(0), nvidia_reading(1))
    beat(
        agents,
        "hx-4",
        nvidia_reading(0, xid_events=[xid(13, "2026-12-01T09:00:00Z", "Graphics Engine Exception")]),
        nvidia_reading(1, xid_events=[xid(79, "2026-12-01T10:00:00Z", "GPU has fallen off the bus")]),
    )
    assert card("hx-4", 0).cordoned_at is None and unhealthy_alerts("hx-4", 0) == []
    gpu = card("hx-4", 1)
    assert gpu.cordoned_at is not None and "Xid 79" in gpu.cordon_reason
    [reason] = gpu.cordon_evidence["reasons"]
    assert (reason["code"], reason["text"], reason["at"]) == (79, "GPU has fallen off the bus", "2026-12-01T10:00:00Z")
    assert len(unhealthy_alerts("hx-4", 1)) == 1


@pytestmark_db
def test_corrected_errors_alone_do_not_cordon(agents):
    beat(agents, "hx-5", nvidia_reading(0), nvidia_reading(1))
    beat(agents, "hx-5", nvidia_reading(0, ecc_corrected_volatile=12, ecc_corrected_aggregate=40), nvidia_reading(1))
    gpu = card("hx-5")
    assert gpu.cordoned_at is None and gpu.last_bad_at is None and gpu.health["ecc_corrected_aggregate"] == 40
    assert unhealthy_alerts("hx-5") == []
    assert not GpuHealthSample.objects.filter(node_id="hx-5", unhealthy=True).exists()


@pytestmark_db
def test_an_operator_cordon_is_kept_when_the_card_turns_unhealthy(agents):
    beat(agents, "hx-6", nvidia_reading(0), nvidia_reading(1))
    Gpu.objects.filter(node_id="hx-6", index=0).update(
        cordoned_at="2026-12-01T00:00:00Z", cordon_source="operator", cordon_reason="bench test"
    )
    beat(agents, "hx-6", nvidia_reading(0, ecc_uncorrected_volatile=1), nvidia_reading(1))
    gpu = card("hx-6")
    assert (gpu.cordon_source, gpu.cordon_reason) == ("operator", "bench test") and gpu.last_bad_at is not None
    assert len(unhealthy_alerts("hx-6")) == 1


@pytestmark_db
def test_a_beat_without_gpu_health_leaves_the_cards_health_alone(agents):
    beat(agents, "hx-7", nvidia_reading(0, ecc_uncorrected_aggregate=1), nvidia_reading(1))
    assert agents.send("hx-7", payload(gpus=2)).status_code == 200
    assert card("hx-7").cordoned_at is not None and Node.objects.get(pk="hx-7").health_hash
