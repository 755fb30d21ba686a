"""The ID token's checks (apps.identity.oidc.verify_id_token, Authlib's parse_id_token, the
path the callback takes): tokens signed here with a key this test controls, the provider's
discovery document and JWKS served over real HTTP on the loopback. A bad signature, a
wrong audience or issuer, an expired token (beyond the clock skew), a nonce not ours and an
unsigned token are refused; the callback refuses a state it never issued."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.test import override_settings
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import RSAKey

from apps.identity import oidc

CLIENT_ID = "heteroflow"
NONCE = "n-0S6_WzA2Mj"


class Issuer:
    """A provider's two public documents; `key` signs the tokens it would issue."""

    def __init__(self):
        self.key = RSAKey.generate_key(2048, parameters={"kid": "signing-1"})
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                documents = {
                    "/.well-known/openid-configuration": issuer.discovery(),
                    "/jwks": {"keys": [issuer.key.as_dict(private=False)]},
                }
                body = json.dumps(documents.get(self.path, {})).encode()
                self.send_response(200 if self.path in documents else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                return  # quiet: the test's output is about the checks

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def discovery(self) -> dict:
        return {
            "issuer": self.url,
            "authorization_endpoint": f"{self.url}/auth",
            "token_endpoint": f"{self.url}/token",
            "jwks_uri": f"{self.url}/jwks",
            "id_token_signing_alg_values_supported": ["RS256"],
        }

    def sign(self, key=None, header=None, **changes) -> dict:
        now = int(time.time())
        claims = {"iss": self.url, "sub": "alice", "aud": CLIENT_ID, "iat": now, "exp": now + 300, "nonce": NONCE}
        claims.update(changes)
        claims = {name: value for name, value in claims.items() if value is not None}
        token = jwt.encode(header or {"alg": "RS256", "kid": "signing-1"}, claims, key or self.key)
        return {"id_token": token}


@pytest.fixture(scope="module")
def issuer():
    issuer = Issuer()
    yield issuer
    issuer.server.shutdown()


@pytest.fixture
def provider(issuer):
    providers = {
        "corp": {
            "issuer": issuer.url,
            "client_id": CLIENT_ID,
            "client_secret": "s",
            "label": "Corp",
            "scopes": "openid groups",
            "groups_claim": "groups",
            "username_claim": "preferred_username",
        }
    }
    with override_settings(HETEROFLOW_OIDC_PROVIDERS=providers, HETEROFLOW_OIDC_CLOCK_SKEW_SECONDS=60):
        yield oidc.provider("corp")


def test_a_good_token_gives_its_claims(issuer, provider):
    claims = oidc.verify_id_token(provider, issuer.sign(groups=["acme-users"]), NONCE)
    assert claims["sub"] == "alice" and claims["groups"] == ["acme-users"]


def test_a_token_expired_within_the_clock_skew_passes(issuer, provider):
    now = int(time.time())
    assert oidc.verify_id_token(provider, issuer.sign(iat=now - 400, exp=now - 30), NONCE)["sub"] == "alice"


def forged_signature(issuer):
    # another key that claims to be the provider's (same kid): the signature cannot verify
    return issuer.sign(key=RSAKey.generate_key(2048, parameters={"kid": "signing-1"}))


@pytest.mark.parametrize(
    "tamper, why",
    [
        pytest.param(forged_signature, "bad_signature", id="bad-signature"),
        pytest.param(lambda issuer: issuer.sign(aud="someone-else", azp=CLIENT_ID), "'aud'", id="wrong-audience"),
        # another audience alone: no azp naming us either
        pytest.param(lambda issuer: issuer.sign(aud=["someone-else", "other"]), "'a", id="wrong-audiences"),
        pytest.param(lambda issuer: issuer.sign(iss="http://127.0.0.1:1/evil"), "'iss'", id="wrong-issuer"),
        pytest.param(
            lambda issuer: issuer.sign(iat=int(time.time()) - 900, exp=int(time.time()) - 120),
            "expired",
            id="expired",
        ),
        pytest.param(lambda issuer: issuer.sign(nonce="replayed-nonce"), "'nonce'", id="wrong-nonce"),
        pytest.param(lambda issuer: issuer.sign(nonce=None), "'nonce'", id="no-nonce"),
        pytest.param(lambda issuer: issuer.sign(exp=None), "'exp'", id="no-expiry"),
    ],
)
def test_a_tampered_token_is_refused(issuer, provider, tamper, why):
    with pytest.raises(JoseError) as refused:
        oidc.verify_id_token(provider, tamper(issuer), NONCE)
    assert why in str(refused.value)


def test_an_unsigned_token_is_refused(issuer, provider):
    now = int(time.time())
    claims = {"iss": issuer.url, "sub": "alice", "aud": CLIENT_ID, "iat": now, "exp": now + 300, "nonce": NONCE}
    header = json.dumps({"alg": "none"}).encode()
    import base64

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    token = f"{b64(header)}.{b64(json.dumps(claims).encode())}."
    with pytest.raises(JoseError):
        oidc.verify_id_token(provider, {"id_token": token}, NONCE)


@pytest.mark.django_db
def test_the_callback_refuses_a_state_it_never_issued(issuer, provider, client):
    response = client.get("/identity/oidc/corp/callback", {"code": "stolen", "state": "forged"})
    assert response.status_code == 400
    assert b"Sign-in with Corp failed" in response.content
    assert "_auth_user_id" not in client.session


@pytest.mark.django_db
def test_the_button_sends_the_browser_to_the_provider_with_pkce_state_and_nonce(issuer, provider, client):
    response = client.get("/identity/oidc/corp/", {"next": "/portal/tasks/"})
    assert response.status_code == 302
    location = response["Location"]
    assert location.startswith(f"{issuer.url}/auth?")
    for parameter in ("code_challenge=", "code_challenge_method=S256", "state=", "nonce=", f"client_id={CLIENT_ID}"):
        assert parameter in location
    # an unknown provider is a 404, and an outside "next" is never followed
    assert client.get("/identity/oidc/nobody/").status_code == 404
    client.get("/identity/oidc/corp/", {"next": "https://evil.example/"})
    assert client.session["identity_next"] == "/portal/"


@pytest.mark.django_db
def test_asked_again_the_provider_must_check_the_person_now(issuer, provider, client):
    location = client.get("/identity/oidc/corp/", {"reauth": "1"})["Location"]
    assert "prompt=login" in location and "max_age=0" in location
    assert "prompt=" not in client.get("/identity/oidc/corp/")["Location"]
