"""The GPU health page (/portal/nodes/gpu-health/) and the GPU admin's cordon actions,
with Django's test client: cards by risk with their evidence, the operators' cordon and
uncordon (a tenant's person sees the page of its nodes, without the buttons, and is
refused the actions), the per-model prediction ("not enough data", never a percentage,
below the minimum) and the capability matrix; "—" for no data."""

from __future__ import annotations

from datetime import timedelta

import pytest

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertState, AlertType
from apps.core.clock import utcnow
from apps.core.models import OperatorAuditEvent
from apps.nodes.models import Gpu
from tests.factories import make_alert
from tests.nodes.health_readings import make_health_sample, nvidia_reading
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db

URL = "/portal/nodes/gpu-health/"


@pytest.fixture
def readings(cluster):
    """alpha (shared-1): card 0 cordoned for its health, 1 with uncorrected errors, 2
    healthy; charlie (beta-1, beta's): card 0 cordoned. bravo's cards never reported."""
    now = utcnow()
    Gpu.objects.filter(node_id="shared-1", index=0).update(
        health=nvidia_reading(0, ecc_uncorrected_aggregate=2),
        health_at=now,
        cordoned_at=now,
        cordon_source="health",
        cordon_reason="unhealthy: Xid 79 (GPU has fallen off the bus)",
        last_bad_at=now,
    )
    Gpu.objects.filter(node_id="shared-1", index=1).update(
        health=nvidia_reading(1, ecc_uncorrected_volatile=1, ecc_uncorrected_aggregate=1), health_at=now
    )
    Gpu.objects.filter(node_id="shared-1", index=2).update(health=nvidia_reading(2), health_at=now)
    Gpu.objects.filter(node_id="beta-1", index=0).update(
        health=nvidia_reading(0), health_at=now, cordoned_at=now, cordon_source="operator", cordon_reason="beta's"
    )
    return make_alert(
        type=AlertType.GPU_UNHEALTHY, key=alert_keys.gpu_unhealthy("shared-1", 0), node_id="shared-1", gpu_index=0
    )


def rows(html: str) -> list[str]:
    return [part.split('"')[0] for part in html.split('data-card="')[1:]]


def row(html: str, card: str) -> str:
    return html.split(f'data-card="{card}"')[1].split("</tr>")[0]


def test_an_operator_sees_the_cards_by_risk_with_evidence_and_the_buttons(client, world, readings):
    html = page(signed_in(client, world.operator), URL)
    order = rows(html)
    # cordoned first (the most uncorrected errors first), then evidence
    assert order[:3] == ["shared-1/0", "beta-1/0", "shared-1/1"]
    assert set(order[3:]) == {"shared-1/2", "shared-1/3", "shared-2/0", "shared-2/1", "beta-1/1", "shared-3/0"}
    cordoned = row(html, "shared-1/0")
    assert 'data-cordon="health"' in cordoned and "Xid 79 (GPU has fallen off the bus)" in cordoned
    assert "Uncordon" in cordoned and "/portal/nodes/shared-1/gpus/0/uncordon/" in cordoned
    evidence = row(html, "shared-1/1")
    assert 'data-evidence="uncorrected_ecc"' in evidence and "volatile 1, aggregate 1" in evidence
    assert ">Cordon</button>" in evidence
    never = row(html, "shared-2/0")  # never reported health: dashes, not zeros
    assert 'data-prediction="no_data"' in never and never.count("—") >= 4
    assert 'aria-current="page">GPU health</a>' in html
    assert "not been checked against real failure data" in html


def test_a_tenant_sees_its_nodes_cards_without_the_buttons_and_is_refused_the_actions(client, world, readings):
    viewer = signed_in(client, world.users["acme-viewer"])
    html = page(viewer, URL)
    assert "beta-1/0" not in rows(html) and "shared-1/0" in rows(html)
    assert ">Cordon</button>" not in html and "Uncordon" not in html
    assert client.post("/portal/nodes/shared-1/gpus/2/cordon/", {"reason": "x"}).status_code == 403
    assert client.post("/portal/nodes/shared-1/gpus/0/uncordon/").status_code == 403
    assert Gpu.objects.get(node_id="shared-1", index=2).cordoned_at is None
    assert Gpu.objects.get(node_id="shared-1", index=0).cordoned_at is not None


def test_an_operator_cordons_and_uncordons_from_the_page(client, world, readings):
    signed_in(client, world.operator)
    response = client.post("/portal/nodes/shared-1/gpus/2/cordon/", {"reason": "noisy fan", "risk": "none"})
    assert response.status_code == 302 and response.url == URL + "?risk=none"
    gpu = Gpu.objects.get(node_id="shared-1", index=2)
    assert (gpu.cordon_source, gpu.cordon_reason) == ("operator", "noisy fan")
    refused = client.post("/portal/nodes/shared-1/gpus/2/cordon/", {"reason": "again"}, follow=True)
    assert "already cordoned" in refused.content.decode()
    empty = client.post("/portal/nodes/shared-1/gpus/1/cordon/", {"reason": ""}, follow=True)
    assert "reason:" in empty.content.decode() and Gpu.objects.get(node_id="shared-1", index=1).cordoned_at is None
    assert client.post("/portal/nodes/shared-1/gpus/9/cordon/", {"reason": "x"}).status_code == 404
    assert client.post("/portal/nodes/nope/gpus/0/uncordon/").status_code == 404

    done = client.post("/portal/nodes/shared-1/gpus/0/uncordon/", follow=True)
    assert "uncordoned" in done.content.decode()
    readings.refresh_from_db()
    assert readings.state == AlertState.RECOVERED
    assert Gpu.objects.get(node_id="shared-1", index=0).cordoned_at is None
    recorded = OperatorAuditEvent.objects.filter(action__startswith="gpu.").order_by("id")
    assert [(e.action, e.target) for e in recorded] == [
        ("gpu.cordon", "shared-1/gpu/2"),
        ("gpu.uncordon", "shared-1/gpu/0"),
    ]


def test_the_prediction_table_says_not_enough_data_or_a_percentage(client, world, readings, settings):
    start = utcnow() - timedelta(days=20)
    for i in range(4):
        make_health_sample(f"old-{i}", 0, start, model="NVIDIA H100", ecc_corrected_aggregate=2)
        if i == 0:
            make_health_sample(f"old-{i}", 0, start + timedelta(days=2), model="NVIDIA H100", unhealthy=True)
    make_health_sample("old-a", 0, start, model="NVIDIA A100", ecc_corrected_aggregate=5)
    Gpu.objects.filter(node_id="shared-1", index=2).update(health=nvidia_reading(2, ecc_corrected_volatile=3))
    settings.HETEROFLOW_GPU_HEALTH_PREDICTION_MIN_CARDS = 30
    html = page(signed_in(client, world.operator), URL)
    h100 = html.split('data-model="NVIDIA H100"')[1].split("</tr>")[0]
    assert "not enough data" in h100 and "%" not in h100
    assert 'data-prediction="not_enough_data">not enough data' in row(html, "shared-1/2")

    settings.HETEROFLOW_GPU_HEALTH_PREDICTION_MIN_CARDS = 4
    html = page(client, URL)
    h100 = html.split('data-model="NVIDIA H100"')[1].split("</tr>")[0]
    assert "25.0% (95% interval" in h100
    assert "not enough data" in html.split('data-model="NVIDIA A100"')[1].split("</tr>")[0]
    assert "25.0% of 4 cards" in row(html, "shared-1/2")


def test_the_capability_matrix_lists_every_vendor(client, world, readings):
    html = page(signed_in(client, world.operator), URL)
    nvidia = html.split('data-vendor="nvidia"')[1].split("</tr>")[0]
    assert 'data-status="reports"' in nvidia and "4 / 9" in nvidia  # reporting cards / cards (one is beta's)
    assert "no cards" in html.split('data-vendor="hygon"')[1].split("</tr>")[0]


# --- the GPU admin ------------------------------------------------------------------------------


def test_the_gpu_admin_cordons_and_uncordons_and_shows_health(client, world, readings):
    client.force_login(world.operator)
    listing = client.get("/admin/nodes/gpu/?cordon=health").content.decode()
    assert "ECC corrected 0, uncorrected 2" in listing and "health since" in listing
    pk = Gpu.objects.get(node_id="shared-1", index=2).pk
    response = client.post("/admin/nodes/gpu/", {"action": "cordon", "_selected_action": [str(pk)]}, follow=True)
    assert "Cordoned GPU 2" in response.content.decode()
    assert Gpu.objects.get(pk=pk).cordon_source == "operator"
    again = client.post("/admin/nodes/gpu/", {"action": "cordon", "_selected_action": [str(pk)]}, follow=True)
    assert "already cordoned" in again.content.decode()
    cordoned = Gpu.objects.get(node_id="shared-1", index=0).pk
    client.post("/admin/nodes/gpu/", {"action": "uncordon", "_selected_action": [str(pk), str(cordoned)]})
    assert not Gpu.objects.filter(pk__in=[pk, cordoned], cordoned_at__isnull=False).exists()
    readings.refresh_from_db()
    assert readings.state == AlertState.RECOVERED
