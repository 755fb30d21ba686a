"""Sign-in brute force is slowed (docs/security.md#sign-in).

Failed sign-ins are counted per username and client address, in Redis (Django's cache),
in windows of HETEROFLOW_LOGIN_FAILURE_WINDOW_SECONDS. The HETEROFLOW_LOGIN_MAX_FAILURES-th
failure in a window locks that username from that address for
HETEROFLOW_LOGIN_LOCKOUT_SECONDS, doubled for each lock-out in a row (at most 64 times
the base) until a sign-in succeeds. While locked, no password is checked at all:
`LockoutBackend`, first in AUTHENTICATION_BACKENDS, stops `authenticate()` for every
sign-in form (the portal's and the admin's). The portal's form answers 429 with
Retry-After. Every failure, lock-out and refused attempt is logged on
`heteroflow.security` (the username, the address; never the password).

The same username from another address is not locked: an attacker cannot lock a person
out of the portal by guessing at their name from elsewhere.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.cache import cache
from django.core.exceptions import PermissionDenied

from apps.core import throttling

logger = logging.getLogger("heteroflow.security")

MAX_BACKOFF_DOUBLINGS = 6  # a lock-out lasts at most 64 times the base


def client_ip(request) -> str:
    """The client's address: the TCP peer, or, when the peer is a trusted proxy
    (HETEROFLOW_TRUSTED_PROXIES), the first address in X-Forwarded-For, read from the
    right, that is not a trusted proxy."""
    peer = request.META.get("REMOTE_ADDR") or ""
    trusted = [ipaddress.ip_network(net, strict=False) for net in settings.HETEROFLOW_TRUSTED_PROXIES]
    if not trusted or not _within(peer, trusted):
        return peer
    forwarded = [part.strip() for part in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if part.strip()]
    for address in reversed(forwarded):
        if not _within(address, trusted):
            return address
    return peer


def _within(address: str, networks) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in networks)


def _ident(username: str, ip: str) -> str:
    return hashlib.sha256(f"{(username or '').strip().lower()}\x00{ip}".encode()).hexdigest()[:32]


def _lock_key(ident: str) -> str:
    return f"login:lock:{ident}"


def _streak_key(ident: str) -> str:
    return f"login:streak:{ident}"


def _fail_key(ident: str, window: int) -> str:
    return f"login:fail:{ident}:{window}"


@dataclass(frozen=True)
class Lock:
    retry_after: int  # seconds


def locked(username: str, ip: str) -> Lock | None:
    """The lock on this username from this address, if one holds now."""
    try:
        until = cache.get(_lock_key(_ident(username, ip)))
    except Exception:  # fail open, as the API's limits do
        logger.warning("sign-in lock-out not read: the cache is unreachable", exc_info=True)
        return None
    if until is None:
        return None
    left = until - throttling.now()
    return Lock(math.ceil(left)) if left > 0 else None


def refused(username: str, ip: str) -> Lock | None:
    """locked(), logging the refusal when it holds."""
    lock = locked(username, ip)
    if lock is not None:
        logger.warning("sign-in refused for %r from %s: locked for %d s more", username, ip, lock.retry_after)
    return lock


def record_failure(username: str, ip: str) -> Lock | None:
    """Count one failed sign-in; the lock it starts, if it is the one too many."""
    ident = _ident(username, ip)
    at = throttling.now()
    window_seconds = settings.HETEROFLOW_LOGIN_FAILURE_WINDOW_SECONDS
    window = int(at // window_seconds)
    try:
        count = throttling.incr(_fail_key(ident, window), timeout=2 * window_seconds + 5)
        logger.warning("sign-in failed for %r from %s (%d in this window)", username, ip, count)
        if count < settings.HETEROFLOW_LOGIN_MAX_FAILURES:
            return None
        streak = cache.get(_streak_key(ident)) or 0
        seconds = settings.HETEROFLOW_LOGIN_LOCKOUT_SECONDS * 2 ** min(streak, MAX_BACKOFF_DOUBLINGS)
        cache.set(_lock_key(ident), at + seconds, timeout=seconds + 1)
        # the streak outlives the lock, so that the next lock-out in a row lasts longer
        cache.set(_streak_key(ident), streak + 1, timeout=2 * seconds + window_seconds)
        cache.delete(_fail_key(ident, window))
    except Exception:
        logger.warning("sign-in failure not counted: the cache is unreachable", exc_info=True)
        return None
    logger.warning("sign-in locked for %r from %s for %d s after %d failures", username, ip, seconds, count)
    return Lock(seconds)


def clear(username: str, ip: str) -> None:
    """A successful sign-in forgets that username's failures from that address."""
    ident = _ident(username, ip)
    window = int(throttling.now() // settings.HETEROFLOW_LOGIN_FAILURE_WINDOW_SECONDS)
    try:
        cache.delete_many([_fail_key(ident, window), _streak_key(ident), _lock_key(ident)])
    except Exception:
        logger.warning("sign-in failures not cleared: the cache is unreachable", exc_info=True)


class LockoutBackend:
    """First in AUTHENTICATION_BACKENDS: while a username is locked from an address,
    `authenticate()` stops here (PermissionDenied) and no password is checked."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if request is None or username is None:
            return None
        lock = refused(username, client_ip(request))
        if lock is not None:
            request.heteroflow_login_lock = lock
            raise PermissionDenied("locked out")
        return None

    # No get_user(): a session is never this backend's, and the test client's
    # force_login() takes the first backend that has one.


def _on_failure(sender, credentials, request=None, **kwargs):
    if request is None or getattr(request, "heteroflow_login_lock", None) is not None:
        return  # refused while locked: already logged, and it must not lengthen the lock
    lock = record_failure(credentials.get("username") or "", client_ip(request))
    if lock is not None:
        request.heteroflow_login_lock = lock


def _on_success(sender, request=None, user=None, **kwargs):
    if request is not None and user is not None:
        clear(user.get_username(), client_ip(request))


user_login_failed.connect(_on_failure, dispatch_uid="heteroflow-login-failure")
user_logged_in.connect(_on_success, dispatch_uid="heteroflow-login-success")
