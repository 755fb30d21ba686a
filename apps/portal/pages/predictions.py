"""How accurate the start-time estimates were (docs/predictions.md#accuracy), for
operators: GET /api/v1/admin/predictions/accuracy as a page, a bar per lead band."""

from __future__ import annotations

from datetime import timedelta

from django.shortcuts import render

from apps.core.clock import utcnow
from apps.portal.access import operators_only, portal_page
from apps.scheduler import predictions

DAYS = (7, 30, 90)


def as_duration(seconds: float | None) -> str:
    """1 h 5 min, 12 min, 40 s: an error in the unit a person reads."""
    if seconds is None:
        return "—"
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    if seconds >= 60:
        return f"{seconds // 60} min"
    return f"{seconds} s"


@portal_page
@operators_only
def prediction_accuracy(request):
    days = int(request.GET["days"]) if request.GET.get("days") in {str(d) for d in DAYS} else 30
    report = predictions.accuracy(utcnow() - timedelta(days=days))
    peak = max((band["median_error_seconds"] or 0 for band in report["bands"]), default=0) or 1
    bands = [
        band
        | {
            "median": as_duration(band["median_error_seconds"]),
            "p90": as_duration(band["p90_error_seconds"]),
            "height": 100 * (band["median_error_seconds"] or 0) / peak,
        }
        for band in report["bands"]
    ]
    first = report["at_submission"]
    return render(
        request,
        "portal/prediction_accuracy.html",
        {
            "days": days,
            "choices": DAYS,
            "bands": bands,
            "first": first | {"median": as_duration(first["median_error_seconds"])},
            "estimates": sum(band["estimates"] for band in bands),
        },
    )
