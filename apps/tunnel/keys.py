"""The control plane's side of the tunnel's trust (docs/tunnel.md#keys).

- Its SSH client key, which every agent accepts (the agent learns it when it registers
  its host key): an ed25519 key derived from SECRET_KEY (HKDF), so every instance of the
  control plane has the same one without storing a private key anywhere, and rotating
  SECRET_KEY rotates it (agents fetch it again at their next connection).
- A node's host key: pinned on first use (apps.tunnel.pinning).
- The relay: a web process asks the tunnel process that holds a node for a session with
  a header signed by a key derived from SECRET_KEY as well (HMAC-SHA256), valid for a
  few seconds, so the relay port admits only the control plane's own processes."""

from __future__ import annotations

import hashlib
import hmac
import time
from functools import cache

import asyncssh
import orjson
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

HEADER_TTL_SECONDS = 30  # a signed relay header is good for this long


def _derived(info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(settings.SECRET_KEY.encode())


@cache
def client_key() -> asyncssh.SSHKey:
    seed = _derived(b"heteroflow tunnel ssh client key v1")
    pem = Ed25519PrivateKey.from_private_bytes(seed).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    return asyncssh.import_private_key(pem)


def client_public_key() -> str:
    return client_key().export_public_key().decode().strip()


@cache
def _relay_key() -> bytes:
    return _derived(b"heteroflow tunnel relay v1")


def sign(header: dict, now: float | None = None) -> bytes:
    """The header as one line: JSON with its expiry and MAC."""
    body = dict(header, exp=int((now or time.time()) + HEADER_TTL_SECONDS))
    payload = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    mac = hmac.new(_relay_key(), payload, hashlib.sha256).hexdigest()
    return orjson.dumps({"h": payload.decode(), "mac": mac}) + b"\n"


def verify(line: bytes, now: float | None = None) -> dict | None:
    """The header a signed line carries; None when it is forged, damaged or expired."""
    try:
        outer = orjson.loads(line)
        payload = outer["h"].encode()
        mac = outer["mac"]
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(mac, str) or not hmac.compare_digest(
        mac, hmac.new(_relay_key(), payload, hashlib.sha256).hexdigest()
    ):
        return None
    header = orjson.loads(payload)
    if not isinstance(header, dict) or header.get("exp", 0) < (now or time.time()):
        return None
    return header


def fingerprint(public_key: str) -> str:
    return asyncssh.import_public_key(public_key).get_fingerprint("sha256")
