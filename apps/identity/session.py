"""Session hygiene (docs/identity.md#sessions): when a session signed in, when it was last
used, and whether it signed in recently enough to create an API key."""

from __future__ import annotations

import time

from django.conf import settings
from django.contrib.auth import logout
from django.contrib.auth.signals import user_logged_in
from django.shortcuts import redirect
from rest_framework.exceptions import PermissionDenied

from apps.identity.error_codes import IdentityErrorCode

SIGNED_IN_AT = "identity_signed_in_at"
SEEN_AT = "identity_seen_at"
SEEN_RESOLUTION = 60  # seconds: a session is written at most once a minute for this


def remember_sign_in(request) -> None:
    now = int(time.time())
    request.session[SIGNED_IN_AT] = now
    request.session[SEEN_AT] = now


def _on_login(sender, request=None, user=None, **kwargs):
    if request is not None and hasattr(request, "session"):
        remember_sign_in(request)


user_logged_in.connect(_on_login, dispatch_uid="heteroflow-identity-signed-in-at")


def signed_in_recently(request) -> bool:
    """Whether the session signed in within HETEROFLOW_REAUTH_SECONDS (always, when 0)."""
    window = settings.HETEROFLOW_REAUTH_SECONDS
    if not window:
        return True
    signed_in = request.session.get(SIGNED_IN_AT)
    return signed_in is not None and time.time() - signed_in <= window


class SessionIdleMiddleware:
    """Ends a session unused for HETEROFLOW_SESSION_IDLE_SECONDS (its absolute lifetime is
    the cookie's age, HETEROFLOW_SESSION_LIFETIME_SECONDS). Sessions only: API keys and
    the hot paths (which do not run Django's middleware) are not touched."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        idle = settings.HETEROFLOW_SESSION_IDLE_SECONDS
        session = getattr(request, "session", None)
        if idle and session is not None and request.user.is_authenticated:
            now = int(time.time())
            seen = session.get(SEEN_AT)
            if seen is not None and now - seen > idle:
                logout(request)
                if request.path.startswith("/portal/"):
                    return redirect(f"{settings.LOGIN_URL}?next={request.path}")
            elif seen is None or now - seen >= SEEN_RESOLUTION:
                session[SEEN_AT] = now
        return self.get_response(request)


REAUTH_MESSAGE = "Sign in again to create an API key: your sign-in is older than this server allows for that."


def refuse_stale_session(request) -> None:
    """Before an API key is created: a person's session (not a key: machines are not asked)
    that signed in longer ago than HETEROFLOW_REAUTH_SECONDS gets a 403 saying so."""
    principal = getattr(request, "auth", None)
    if principal is None or principal.api_key is not None or principal.is_agent:
        return
    if not signed_in_recently(request):
        raise PermissionDenied(REAUTH_MESSAGE, code=IdentityErrorCode.REAUTHENTICATION_REQUIRED)


def reauthentication_url(next_path: str) -> str:
    """The sign-in page that asks a signed-in person again, then goes back to next_path."""
    from django.utils.http import urlencode

    return f"{settings.LOGIN_URL}?{urlencode({'next': next_path, 'reauth': 1})}"
