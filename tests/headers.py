"""The headers the tests authenticate with, in one place. The Django test client takes
them as environ keys (`HTTP_…`, spread into a call: `api.get(url, **bearer(key))`); a
real HTTP client (httpx, requests) takes header names (the `_http` forms)."""

from __future__ import annotations

from django.conf import settings


def bearer(key: str) -> dict:
    """A user's or a platform API key, for the Django test client."""
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def bearer_http(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def tenant_header(slug: str) -> dict:
    """The tenant a user of several tenants acts for, for the Django test client."""
    return {"HTTP_X_HETEROFLOW_TENANT": slug}


# The node agent's shared secret: for the Django test client, and for a real HTTP client.
AGENT = {"HTTP_X_API_KEY": settings.HETEROFLOW_AGENT_SECRET}
AGENT_HTTP = {"X-API-Key": settings.HETEROFLOW_AGENT_SECRET}
