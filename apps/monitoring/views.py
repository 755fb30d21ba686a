"""Unauthenticated endpoints: liveness for load balancers and systemd, and /metrics.

/health answers 503 only when this instance cannot reach its database (it can serve
nothing). A scheduler that is not running is "degraded" with 200: taking web instances
out of rotation would not start it, and would only push the API traffic elsewhere.
No error text leaves.
"""

from django.http import HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from apps.core.errors import error_body
from apps.monitoring import access, exposition, probes
from apps.monitoring.error_codes import MonitoringErrorCode


def _liveness() -> tuple[int, dict]:
    if not probes.database_answers():
        return 503, {"status": "unhealthy", "database": "unreachable", "scheduler": "unknown"}
    scheduler = probes.scheduler_state()
    status = "ok" if scheduler == "running" else "degraded"
    return 200, {"status": status, "database": "ok", "scheduler": scheduler}


@never_cache
@require_GET
def health(request):
    code, body = _liveness()
    return JsonResponse({"status": body["status"]}, status=code)


@never_cache
@require_GET
def health_detail(request):
    code, body = _liveness()
    return JsonResponse(body, status=code)


@never_cache
@require_GET
def metrics(request):
    """Prometheus exposition. No credentials; only peers on loopback, private and CGNAT
    addresses (apps.monitoring.access), judged on the TCP peer, never a header."""
    if not access.peer_may_scrape(request.META.get("REMOTE_ADDR")):
        return JsonResponse(
            error_body(MonitoringErrorCode.FORBIDDEN, "Metrics are served to private and loopback addresses only."),
            status=403,
        )
    body, content_type = exposition.render(exposition.WEB, request.META.get("HTTP_ACCEPT", ""))
    return HttpResponse(body, content_type=content_type)
