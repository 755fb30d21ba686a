"""OpenID Connect's two steps in the browser (docs/identity.md#openid-connect): the
button's redirect to the provider, and the provider's redirect back. Thin: the checks are
Authlib's and apps.identity.oidc's, the changes apps.identity.services'."""

from __future__ import annotations

import logging

from authlib.common.errors import AuthlibBaseError
from django.conf import settings
from django.contrib.auth import login
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from joserfc.errors import JoseError
from requests import RequestException

from apps.identity import oidc, services
from apps.identity.session import remember_sign_in

logger = logging.getLogger("heteroflow.security")

SESSION_NEXT = "identity_next"
SESSION_PROVIDER = "identity_provider"
SESSION_LOGOUT_HINT = "identity_logout_hint"  # the ID token, for id_token_hint
DIRECTORY_BACKEND = "apps.identity.backends.DirectoryBackend"


def _provider_or_404(name: str) -> oidc.Provider:
    provider = oidc.provider(name)
    if provider is None:
        raise Http404(f"No sign-in provider named {name!r}.")
    return provider


def safe_next(request, target: str | None) -> str:
    if target and url_has_allowed_host_and_scheme(target, {request.get_host()}, require_https=request.is_secure()):
        return target
    return settings.LOGIN_REDIRECT_URL


def refusal(request, title: str, reason: str, status: int):
    return render(request, "portal/sign_in_refused.html", {"title": title, "reason": reason}, status=status)


@require_GET
@never_cache
def oidc_start(request, name):
    provider = _provider_or_404(name)
    request.session[SESSION_NEXT] = safe_next(request, request.GET.get("next"))
    callback = request.build_absolute_uri(reverse("identity:oidc-callback", args=[name]))
    # asked again (?reauth=1): the provider must check who they are now, not reuse its session
    again = {"prompt": "login", "max_age": 0} if request.GET.get("reauth") else {}
    try:
        return oidc.client(provider).authorize_redirect(request, callback, **again)
    except (RequestException, AuthlibBaseError, ValueError) as exc:
        logger.warning("sign-in with %s: the provider's discovery failed: %s", name, exc)
        return refusal(
            request,
            f"{provider.label} cannot be reached",
            "HeteroFlow could not read the provider's configuration. Try again later, or tell an operator.",
            502,
        )


@require_GET
@never_cache
def oidc_callback(request, name):
    provider = _provider_or_404(name)
    try:
        token = oidc.client(provider).authorize_access_token(request, **oidc.check_options(provider))
        if "userinfo" not in token:
            raise ValueError("the provider sent no ID token")
    except (AuthlibBaseError, JoseError, RequestException, ValueError, KeyError) as exc:
        # a reused or forged state, an error from the provider, an ID token that fails its
        # checks: nobody is signed in, and the reason goes to the security log only
        logger.warning("sign-in with %s refused: %s: %s", name, type(exc).__name__, exc)
        return refusal(
            request,
            f"Sign-in with {provider.label} failed",
            "The answer from the identity provider could not be verified, or this sign-in link was used "
            "already. Start again from the sign-in page.",
            400,
        )
    account = oidc.account_from(provider, dict(token["userinfo"]), token)
    try:
        user = services.sign_in(account)
    except services.SignInRefused as refused:
        return refusal(request, "You cannot sign in to HeteroFlow", refused.reason, 403)
    target = request.session.pop(SESSION_NEXT, None)
    login(request, user, backend=DIRECTORY_BACKEND)
    request.session[SESSION_PROVIDER] = name
    request.session[SESSION_LOGOUT_HINT] = token.get("id_token", "")
    remember_sign_in(request)
    return redirect(safe_next(request, target))


def provider_logout_url(request, name: str | None, id_token: str | None) -> str | None:
    """Where RP-initiated logout sends the browser: the provider's end_session_endpoint,
    back to the sign-in page afterwards; None when the provider has none."""
    provider = oidc.provider(name) if name else None
    if provider is None:
        return None
    back = request.build_absolute_uri(settings.LOGOUT_REDIRECT_URL)
    try:
        return oidc.client(provider).create_logout_url(
            post_logout_redirect_uri=back, id_token_hint=id_token or None, client_id=provider.config["client_id"]
        )["url"]
    except (RuntimeError, RequestException, AuthlibBaseError) as exc:
        logger.info("no provider logout for %s: %s", name, exc)
        return None
