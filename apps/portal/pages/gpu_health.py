"""The GPU health page (/portal/nodes/gpu-health/, docs/gpu-health.md#the-page): the
cards by risk with their evidence and cordon state, the per-model failure prediction
("not enough data" below the minimum, never a percentage) and the capability matrix.
Reads come from apps.nodes.gpu_health_selectors, as the API's do; cordon and uncordon
are the operators' and go through apps.nodes.gpu_health_services with the API's
serializers, so the page says what the API would say."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import urlencode
from django.views.decorators.http import require_POST
from rest_framework.exceptions import NotFound

from apps.core.views import get_visible_or_404
from apps.nodes import gpu_health_selectors as health
from apps.nodes import gpu_health_services
from apps.nodes.api.gpu_health import CordonSerializer, UncordonSerializer
from apps.nodes.models import Node
from apps.portal.access import operators_only, portal_page
from apps.portal.pages.common import choice, paginate, through_api

RISK_LABELS = {"": "Any risk", "cordoned": "Cordoned", "evidence": "With evidence", "none": "No evidence"}


@portal_page
def gpu_health(request):
    principal = request.principal
    risk = choice(request.GET.get("risk", ""), RISK_LABELS, "")
    page = paginate(request, health.cards_by_risk(principal, risk=risk))
    stats = health.statistics_by_model(principal)
    cards = [health.present_card(gpu, stats) for gpu in page]
    for card in cards:
        card["prediction"]["shown"] = shown_prediction(card["prediction"])
    return render(
        request,
        "portal/gpu_health.html",
        {
            "page": page,
            "cards": cards,
            "risk": risk,
            "risks": RISK_LABELS,
            "models": [stats[model].as_dict() | {"shown": shown_statistics(stats[model])} for model in sorted(stats)],
            "min_cards": health.prediction_min_cards(),
            "caveat": health.PREDICTION_CAVEAT,
            "capabilities": health.capability_matrix(principal),
        },
    )


def percent(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"


def shown_statistics(stats) -> str:
    """A model's figure in words: a percentage only with enough cards."""
    if stats.status != "estimate":
        return "not enough data"
    return (
        f"{percent(stats.failure_fraction)} (95% interval {percent(stats.interval_low)}–{percent(stats.interval_high)})"
    )


def shown_prediction(prediction: dict) -> str:
    status = prediction["status"]
    if status == "estimate":
        low, high = prediction["interval"]
        return (
            f"{percent(prediction['failure_fraction'])} of {prediction['cards_with_corrected']} cards "
            f"(95% interval {percent(low)}–{percent(high)})"
        )
    if status == "not_enough_data":
        return "not enough data"
    if status == "not_applicable":
        return "no corrected errors"
    return "—"


def _back(request) -> str:
    url = reverse("portal:gpu-health")
    kept = {key: request.POST[key] for key in ("risk", "page") if request.POST.get(key)}
    return url + ("?" + urlencode(kept) if kept else "")


@require_POST
@portal_page
@operators_only
def gpu_cordon(request, node_id, index):
    node = get_visible_or_404(Node, request.principal, pk=node_id)
    try:
        _, errors = through_api(
            CordonSerializer,
            {"reason": request.POST.get("reason", "")},
            lambda data: gpu_health_services.cordon_card(node, index, data["reason"], request.principal),
        )
    except NotFound:
        raise Http404 from None
    _report(request, errors, f"GPU {index} of {node.name} cordoned.")
    return redirect(_back(request))


@require_POST
@portal_page
@operators_only
def gpu_uncordon(request, node_id, index):
    node = get_visible_or_404(Node, request.principal, pk=node_id)
    try:
        _, errors = through_api(
            UncordonSerializer, {}, lambda data: gpu_health_services.uncordon_card(node, index, request.principal)
        )
    except NotFound:
        raise Http404 from None
    _report(request, errors, f"GPU {index} of {node.name} uncordoned: it takes placements again.")
    return redirect(_back(request))


def _report(request, errors: dict, success: str) -> None:
    if errors:
        for field, problems in errors.items():
            prefix = "" if field == "__all__" else f"{field}: "
            messages.error(request, prefix + " ".join(problems))
    else:
        messages.success(request, success)
