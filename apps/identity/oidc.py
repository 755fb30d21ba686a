"""OpenID Connect sign-in through Authlib (docs/identity.md#openid-connect).

Each provider of HETEROFLOW_OIDC_PROVIDERS is an Authlib client found by discovery
(ISSUER/.well-known/openid-configuration), using the authorization code flow with PKCE
(S256), a state and a nonce kept in the session (each used once: Authlib pops the state),
and the ID token checked by `verify_id_token`: its signature against the provider's JWKS,
iss, aud, exp and iat (with HETEROFLOW_OIDC_CLOCK_SKEW_SECONDS of leeway), and the nonce.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from authlib.integrations.django_client import DjangoOAuth2App, OAuth
from django.conf import settings

from apps.identity.services import DirectoryAccount

logger = logging.getLogger("heteroflow.security")

_clients: dict[tuple, DjangoOAuth2App] = {}
_clients_lock = threading.Lock()


@dataclass(frozen=True)
class Provider:
    name: str
    label: str
    config: dict

    @property
    def source(self) -> str:
        return f"oidc:{self.name}"


def providers() -> list[Provider]:
    return [Provider(name, config["label"], config) for name, config in settings.HETEROFLOW_OIDC_PROVIDERS.items()]


def provider(name: str) -> Provider | None:
    config = settings.HETEROFLOW_OIDC_PROVIDERS.get(name)
    return Provider(name, config["label"], config) if config else None


def client(provider: Provider) -> DjangoOAuth2App:
    """The provider's Authlib client, one per configuration (its discovery document and
    keys are cached in it; a key it does not know makes it fetch the JWKS again)."""
    config = provider.config
    key = (provider.name, config["issuer"], config["client_id"], config["client_secret"], config["scopes"])
    with _clients_lock:
        if key not in _clients:
            registry = OAuth()
            _clients[key] = registry.register(
                name=provider.name,
                client_id=config["client_id"],
                client_secret=config["client_secret"] or None,
                server_metadata_url=config["issuer"].rstrip("/") + "/.well-known/openid-configuration",
                client_kwargs={"scope": config["scopes"], "code_challenge_method": "S256", "timeout": 10},
            )
        return _clients[key]


def claims_options(provider: Provider) -> dict:
    """What the ID token's claims must be. Authlib checks `aud` only when told to (left to
    itself it checks `azp`, which a token for another client may carry as ours): the
    audience must be our client id, the issuer the one discovery named."""
    metadata = client(provider).load_server_metadata()
    return {
        "iss": {"essential": True, "values": [metadata.get("issuer") or provider.config["issuer"]]},
        "aud": {"essential": True, "values": [provider.config["client_id"]]},
        "exp": {"essential": True},
    }


def check_options(provider: Provider) -> dict:
    """The keyword arguments of every ID token check: the callback's (Authlib's
    authorize_access_token) and verify_id_token's."""
    return {"claims_options": claims_options(provider), "leeway": settings.HETEROFLOW_OIDC_CLOCK_SKEW_SECONDS}


def verify_id_token(provider: Provider, token: dict, nonce: str) -> dict:
    """The ID token's claims once its signature and claims check out; raises Authlib's
    JoseError (bad signature, wrong iss or aud, expired, a nonce not ours) otherwise."""
    return dict(client(provider).parse_id_token(token, nonce=nonce, **check_options(provider)))


def account_from(provider: Provider, claims: dict, token: dict) -> DirectoryAccount:
    """What the provider says about the person: the ID token's claims, and the userinfo
    endpoint's for the groups when the ID token leaves them out (some providers only put
    them there)."""
    groups_claim = provider.config["groups_claim"]
    groups = claims.get(groups_claim)
    if groups is None and token.get("access_token"):
        try:
            groups = client(provider).userinfo(token=token).get(groups_claim)
        except Exception:  # a provider without userinfo: no groups, so the mapping refuses
            logger.warning("userinfo of %s not read", provider.name, exc_info=True)
    if isinstance(groups, str):
        groups = [groups]
    username = claims.get(provider.config["username_claim"]) or claims.get("email") or claims["sub"]
    return DirectoryAccount(
        source=provider.source,
        subject=str(claims["sub"]),
        username=str(username),
        email=str(claims.get("email") or ""),
        groups=tuple(str(group) for group in (groups or ())),
    )
