"""The server monitoring panel on the dashboard (platform operators only): a set of live
cards per control-plane host, history charts per host, and the six-point health check.

Reads are the monitoring app's own: `selectors.latest_samples` and `selectors.history`
(the samples each host's Celery worker stores every 30 s), `checks.run_all` (what
GET /api/v1/server/health-check answers). The page never calls `selectors.live()`: it
measures the CPU for up to a second, which a page load must not wait for. The script
(static/portal/server_panel.js) reads the live endpoint for the host that answers, this
page's `server_hosts` JSON for the others, and the health-check and history endpoints,
all with the session."""

from __future__ import annotations

from dataclasses import fields
from datetime import datetime, timedelta

from django.http import JsonResponse
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from apps.core.clock import utcnow
from apps.core.error_codes import CoreErrorCode
from apps.core.errors import error_body
from apps.monitoring import checks, hostmetrics, selectors
from apps.monitoring.models import ServerMetric
from apps.portal.access import portal_page

# the panel's ranges: hours -> label (the API takes any 1..168; the panel offers four)
SERVER_RANGES = {"1": "1 h", "6": "6 h", "24": "24 h", "168": "7 d"}
DEFAULT_RANGE = "1"
REFRESH_SECONDS = 5  # the cards and the health check are read again this often (spec 003)
# the cards' colours (spec 003): red above the last limit, amber above the first where
# there are two; the template's `level` filter and the script read these same limits
THRESHOLDS = {
    "cpu_percent": "80",
    "memory_percent": "80",
    "disk_percent": "90",
    "cpu_temperature_celsius": "60,80",
}
# each host is sampled every 30 s: a newest sample older than three periods means its
# worker stopped sampling it, and the card says so instead of showing old figures as now
STALE_AFTER = timedelta(seconds=90)
READINGS = tuple(f.name for f in fields(hostmetrics.HostSample)) + (
    "net_recv_bytes_per_second",
    "net_sent_bytes_per_second",
)
CHECK_LABELS = {
    "database": "Database",
    "storage": "Storage",
    "scheduler": "Scheduler",
    "gpu_nodes": "GPU nodes",
    "broker": "Broker (Redis)",
    "configuration": "Configuration",
}


class BadRange(ValueError):
    pass


def server_range(query) -> str:
    """The panel's range from the dashboard's query: absent means 1 h; anything but the
    four offered ranges is refused (never quietly replaced by another range)."""
    hours = query.get("hours")
    if hours is None:
        return DEFAULT_RANGE
    if hours not in SERVER_RANGES:
        offered = ", ".join(f"{value} ({label})" for value, label in SERVER_RANGES.items())
        raise BadRange(f"hours: '{hours[:20]}' is not a range of the server panel; choose one of {offered}.")
    return hours


def host_card(sample: ServerMetric, now: datetime) -> dict:
    age = max(0.0, (now - sample.at).total_seconds())
    return {
        "host": sample.host,
        "at": sample.at,
        "source": "sample",
        "age_seconds": round(age, 1),
        "stale": age > STALE_AFTER.total_seconds(),
        **{name: getattr(sample, name) for name in READINGS},
    }


def host_cards(now: datetime | None = None) -> dict:
    """Each host's newest stored sample, and which host this web process runs on (the
    one the live endpoint describes)."""
    now = now or utcnow()
    return {
        "now": now,
        "this_host": hostmetrics.host_name(),
        "stale_after_seconds": STALE_AFTER.total_seconds(),
        "hosts": [host_card(sample, now) for sample in selectors.latest_samples(now=now)],
    }


def panel_context(request) -> dict:
    """What the dashboard renders for an operator. A bad range is the only error: the
    panel then shows the refusal and does none of the reads."""
    try:
        hours = server_range(request.GET)
    except BadRange as exc:
        return {"error": str(exc), "ranges": SERVER_RANGES, "hours": None}
    now = utcnow()
    cards = host_cards(now)
    hosts = {card["host"] for card in cards["hosts"]}
    history = selectors.history(int(hours), now=now)
    return {
        "hours": hours,
        "ranges": SERVER_RANGES,
        "refresh_seconds": REFRESH_SECONDS,
        "thresholds": THRESHOLDS,
        "cards": cards["hosts"],
        "this_host": cards["this_host"],
        "this_host_sampled": cards["this_host"] in hosts,
        "platform": hostmetrics.platform_facts(),
        "health": checks.run_all(now),
        "check_labels": CHECK_LABELS,
        "summary": range_summary(history),
        "data": {
            "hours": int(hours),
            "ranges": SERVER_RANGES,
            "refresh_seconds": REFRESH_SECONDS,
            "thresholds": THRESHOLDS,
            "this_host": cards["this_host"],
            "stale_after_seconds": cards["stale_after_seconds"],
            "check_labels": CHECK_LABELS,
            "history": history,
            "urls": {
                "live": reverse("server-metrics"),
                "history": reverse("server-metrics-history"),
                "health": reverse("server-health-check"),
                "hosts": reverse("portal:server-hosts"),
            },
        },
    }


def _stats(points: list[dict], name: str) -> dict:
    values = [point[name] for point in points if point[name] is not None]
    if not values:
        return {"avg": None, "max": None}
    return {"avg": sum(values) / len(values), "max": max(values)}


def range_summary(history: dict) -> list[dict]:
    """Per host over the range: the averages and peaks of the charted readings (what a
    browser without JavaScript gets instead of the charts). Missing readings stay None."""
    return [
        {
            "host": series["host"],
            "points": len(series["points"]),
            **{
                name: _stats(series["points"], name)
                for name in (
                    "cpu_percent",
                    "memory_percent",
                    "disk_percent",
                    "net_recv_bytes_per_second",
                    "net_sent_bytes_per_second",
                    "cpu_temperature_max_celsius",
                )
            },
        }
        for series in sorted(history["hosts"], key=lambda item: item["host"])
    ]


@never_cache
@require_GET
@portal_page
def server_hosts(request):
    """Each host's newest stored sample, for the panel's refresh. Operators only, as the
    monitoring API is; others get the API's 403 body."""
    if not request.principal.is_operator:
        return JsonResponse(
            error_body(CoreErrorCode.PERMISSION_DENIED, "Only platform operators can read server metrics."), status=403
        )
    return JsonResponse(host_cards())
