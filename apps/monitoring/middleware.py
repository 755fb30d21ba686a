"""Answers liveness probes and Prometheus scrapes before anything that could turn them away.

Load balancers, orchestrators and scrapers come by IP over plain HTTP: Django's host
check would answer 400 and the HTTPS redirect 301, and a probe would call a healthy
instance dead. The probes reveal nothing but a status word, and /metrics keeps its own
gate (the peer address), so they are answered first.

Sync and async capable, so that under ASGI it adds no thread hop to other requests.
"""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async

from apps.monitoring import views

PROBES = {"/health": views.health, "/health/detail": views.health_detail, "/metrics": views.metrics}


class HealthProbeMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        probe = PROBES.get(request.path_info)
        return probe(request) if probe is not None else self.get_response(request)

    async def _acall(self, request):
        probe = PROBES.get(request.path_info)
        if probe is not None:
            return await sync_to_async(probe)(request)
        return await self.get_response(request)
