"""Sign-in brute force is slowed and logged (apps.core.login_limits): the N-th failure of
one username from one address locks it out (429, Retry-After) and no password is checked
while the lock holds, even the right one; the lock ends when its time is up, and lasts
longer each time in a row; another address, another username and a successful sign-in
are not affected. Time is moved with time-machine; the counters are the real ones."""

from __future__ import annotations

import logging
import secrets

import pytest
import time_machine
from django.test import Client

from apps.core import login_limits
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

T0 = 1_800_000_000.0
PASSWORD = "pw-for-tests-only"  # tests.factories.UserFactory's


@pytest.fixture
def clock():
    """Still at the start of a window of its own (earlier runs' counters may linger)."""
    start = T0 + 900 * secrets.randbelow(100_000)
    with time_machine.travel(start, tick=False) as traveller:
        yield traveller


@pytest.fixture
def person():
    return UserFactory(username=f"limit-{secrets.token_hex(4)}")


@pytest.fixture
def limits(settings):
    settings.HETEROFLOW_LOGIN_MAX_FAILURES = 3
    settings.HETEROFLOW_LOGIN_FAILURE_WINDOW_SECONDS = 900
    settings.HETEROFLOW_LOGIN_LOCKOUT_SECONDS = 60
    return settings


def sign_in(username, password, ip="198.51.100.20"):
    return Client(REMOTE_ADDR=ip).post("/portal/login/", {"username": username, "password": password})


def test_the_third_failure_locks_the_username_from_that_address(person, limits, clock, caplog):
    caplog.set_level(logging.WARNING, logger="heteroflow.security")
    assert [sign_in(person.username, "wrong").status_code for _ in range(2)] == [200, 200]
    locked = sign_in(person.username, "wrong")
    assert locked.status_code == 429
    assert locked["Retry-After"] == "60"
    assert b"Too many failed sign-ins" in locked.content
    # while locked, even the right password is refused, and no password is checked
    clock.shift(20)
    client = Client(REMOTE_ADDR="198.51.100.20")
    right = client.post("/portal/login/", {"username": person.username, "password": PASSWORD})
    assert right.status_code == 429 and right["Retry-After"] == "40"
    assert "_auth_user_id" not in client.session
    messages = [r.getMessage() for r in caplog.records if r.name == "heteroflow.security"]
    assert sum("sign-in failed" in m for m in messages) == 3
    assert any("sign-in locked" in m and "for 60 s after 3 failures" in m for m in messages)
    assert any("sign-in refused" in m for m in messages)
    assert all(PASSWORD not in m and "wrong" not in m for m in messages)  # never a password


def test_the_lock_ends_when_its_time_is_up(person, limits, clock):
    for _ in range(3):
        sign_in(person.username, "wrong")
    assert sign_in(person.username, PASSWORD).status_code == 429
    clock.shift(60)
    welcome = sign_in(person.username, PASSWORD)
    assert welcome.status_code == 302 and welcome["Location"] == "/portal/"


def test_each_lock_in_a_row_lasts_twice_as_long(person, limits, clock):
    for _ in range(3):
        first = sign_in(person.username, "wrong")
    assert first["Retry-After"] == "60"
    clock.shift(60)
    for _ in range(3):
        second = sign_in(person.username, "wrong")
    assert second.status_code == 429 and second["Retry-After"] == "120"
    clock.shift(120)
    # a success ends the streak: the next lock is the base length again
    assert sign_in(person.username, PASSWORD).status_code == 302
    for _ in range(3):
        third = sign_in(person.username, "wrong")
    assert third["Retry-After"] == "60"


def test_another_address_and_another_username_are_not_locked(person, limits, clock):
    other = UserFactory(username=f"other-{secrets.token_hex(4)}")
    for _ in range(3):
        sign_in(person.username, "wrong")
    assert sign_in(person.username, PASSWORD).status_code == 429
    assert sign_in(person.username, PASSWORD, ip="203.0.113.99").status_code == 302
    assert sign_in(other.username, PASSWORD).status_code == 302
    # the username is matched whatever its case
    assert sign_in(person.username.upper(), PASSWORD).status_code == 429


def test_failures_spread_over_windows_do_not_lock(person, limits, clock):
    for _ in range(2):
        assert sign_in(person.username, "wrong").status_code == 200
    clock.shift(900)  # the next window
    for _ in range(2):
        assert sign_in(person.username, "wrong").status_code == 200
    assert sign_in(person.username, PASSWORD).status_code == 302


def test_a_success_forgets_the_failures(person, limits, clock):
    for _ in range(2):
        sign_in(person.username, "wrong")
    assert sign_in(person.username, PASSWORD).status_code == 302
    for _ in range(2):
        assert sign_in(person.username, "wrong").status_code == 200


def test_the_admin_sign_in_is_locked_too(person, limits, clock):
    person.is_staff = True
    person.save()
    client = Client(REMOTE_ADDR="198.51.100.21")
    for _ in range(3):
        client.post("/admin/login/", {"username": person.username, "password": "wrong"})
    refused = client.post("/admin/login/?next=/admin/", {"username": person.username, "password": PASSWORD})
    assert refused.status_code == 200  # the admin's form, with its error: no session
    assert "_auth_user_id" not in client.session
    clock.shift(60)
    client.post("/admin/login/?next=/admin/", {"username": person.username, "password": PASSWORD})
    assert "_auth_user_id" in client.session


def test_behind_a_trusted_proxy_the_forwarded_client_is_counted(person, limits, clock, settings):
    settings.HETEROFLOW_TRUSTED_PROXIES = ["10.0.0.0/8"]

    def via_proxy(client_ip, password):
        return Client(REMOTE_ADDR="10.0.0.5", HTTP_X_FORWARDED_FOR=f"{client_ip}, 10.0.0.7").post(
            "/portal/login/", {"username": person.username, "password": password}
        )

    for _ in range(3):
        via_proxy("198.51.100.30", "wrong")
    assert via_proxy("198.51.100.30", PASSWORD).status_code == 429
    assert via_proxy("198.51.100.31", PASSWORD).status_code == 302
    # an untrusted peer's forwarded header is not believed
    spoofed = Client(REMOTE_ADDR="192.0.2.1", HTTP_X_FORWARDED_FOR="198.51.100.30")
    assert spoofed.post("/portal/login/", {"username": person.username, "password": PASSWORD}).status_code == 302


def test_an_unreachable_cache_does_not_stop_sign_in(person, limits, clock, monkeypatch):
    def down(*args, **kwargs):
        raise ConnectionError("redis is restarting")

    monkeypatch.setattr(login_limits.cache, "get", down)
    monkeypatch.setattr(login_limits.throttling, "incr", down)
    assert [sign_in(person.username, "wrong").status_code for _ in range(4)] == [200] * 4
    assert sign_in(person.username, PASSWORD).status_code == 302
