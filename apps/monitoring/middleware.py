"""Answers liveness probes before anything that could turn them away.

Load balancers and orchestrators probe by IP over plain HTTP: Django's host check would
answer 400 and the HTTPS redirect 301, and a probe would call a healthy instance dead.
The probes reveal nothing but a status word, so they are answered first.
"""

from apps.monitoring import views

PROBES = {"/health": views.health, "/health/detail": views.health_detail}


class HealthProbeMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        probe = PROBES.get(request.path_info)
        if probe is not None:
            return probe(request)
        return self.get_response(request)
