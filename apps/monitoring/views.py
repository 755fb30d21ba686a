"""Unauthenticated liveness endpoints for load balancers and systemd.

/health answers 503 only when this instance cannot reach its database (it can serve
nothing). A scheduler that is not running is "degraded" with 200: taking web instances
out of rotation would not start it, and would only push the API traffic elsewhere.
No error text leaves.
"""

from django.http import JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from apps.monitoring import probes


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
