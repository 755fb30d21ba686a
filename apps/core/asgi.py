"""Helpers for the thin ASGI routes that sit in front of Django (the heartbeat, the task
create): reading a request's headers from the ASGI scope as Django would read them."""

from __future__ import annotations

from django.conf import settings
from django.http.request import split_domain_port, validate_host


def header(scope, name: bytes) -> str | None:
    """The value of header `name` (lower case, as ASGI gives names), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def is_secure(scope) -> bool:
    """HttpRequest.is_secure() for an ASGI scope: https, or the proxy header the operator
    trusts (SECURE_PROXY_SSL_HEADER)."""
    if scope.get("scheme") == "https":
        return True
    proxy_header = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy_header:
        name, value = proxy_header
        wire_name = name.removeprefix("HTTP_").lower().replace("_", "-").encode()
        return header(scope, wire_name) == value
    return False


def host_is_allowed(scope) -> bool:
    """What HttpRequest.get_host() checks: the Host header against ALLOWED_HOSTS."""
    return bool(validate_host(split_domain_port(header(scope, b"host") or "")[0], settings.ALLOWED_HOSTS))
