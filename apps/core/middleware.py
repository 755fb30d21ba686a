"""Security headers Django's own middleware does not set (docs/security.md#headers):
a Content-Security-Policy and a Permissions-Policy on every HTML page.

The portal's pages load scripts and style sheets from /static/ only and have no inline
scripts or event handlers (templates/portal, static/portal/forms.js), so the policy
allows `'self'` and nothing inline but style attributes (`style-src-attr`, used for
meters' widths; they cannot run code). Pages with inline code of their own get the
policy with that allowed (HETEROFLOW_CSP_BY_PATH): the API documentation (Swagger UI's
inline script and style block) and the admin (inline <style> blocks in Django's and
django-tenants' admin templates; scripts stay 'self'). JSON answers get no policy: a
browser does not render them as a document.

Sync and async capable, so that under ASGI it adds no thread hop.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings


class SecurityHeadersMiddleware:
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
        return add_headers(request, self.get_response(request))

    async def _acall(self, request):
        return add_headers(request, await self.get_response(request))


def policy_for(path: str) -> str:
    for prefix, policy in settings.HETEROFLOW_CSP_BY_PATH.items():
        if path.startswith(prefix):
            return policy
    return settings.HETEROFLOW_CSP


def add_headers(request, response):
    if not response.get("Content-Type", "").startswith("text/html"):
        return response
    policy = policy_for(request.path_info)
    if policy and "Content-Security-Policy" not in response:
        response["Content-Security-Policy"] = policy
    if settings.HETEROFLOW_PERMISSIONS_POLICY and "Permissions-Policy" not in response:
        response["Permissions-Policy"] = settings.HETEROFLOW_PERMISSIONS_POLICY
    return response
