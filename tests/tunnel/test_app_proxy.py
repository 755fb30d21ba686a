"""The interactive apps' proxy (apps.tunnel.api.app_proxy) without a tunnel: it answers
only on the apps' own host, which serves nothing else; without its cookie nothing reaches
an app; the cookie is the task's and untampered; the browser's headers reach the app
without the proxy's or the control plane's cookies, with the app's token; the agent's
base URL for an app is the proxy's path."""

from __future__ import annotations

import asyncio
import time

import pytest
import time_machine
from django.core import signing

from apps.tunnel.api import app_proxy
from heteroflow_agent.interactive import base_url


def scope(host: str, path: str = "/apps/7/api/status", cookie: str = "", **extra) -> dict:
    headers = [(b"host", host.encode())]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    return {"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": headers, **extra}


def run(app, scope_):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope_, receive, send))
    return sent


def test_only_the_apps_host_is_served_and_nothing_without_the_cookie(settings):
    reached = []

    async def django(scope_, receive, send):
        reached.append(scope_["headers"][0][1])

    proxy = app_proxy.AppProxy(django)
    settings.HETEROFLOW_APP_HOST = ""
    run(proxy, scope("apps.example"))  # off: Django's (a 404 there)
    settings.HETEROFLOW_APP_HOST = "{id}.apps.example"
    run(proxy, scope("portal.example"))  # the control plane's host: never an app
    assert reached == [b"apps.example", b"portal.example"]
    for host, path in (("8.apps.example", "/apps/7/api/status"), ("7.apps.example", "/api/v1/tasks")):
        sent = run(proxy, scope(host, path))  # another task's host; the control plane's API on an app's
        assert sent[0]["status"] == 404 and b"Only interactive tasks' apps" in sent[1]["body"]
    sent = run(proxy, scope("7.apps.example"))
    assert sent[0]["status"] == 403 and b"Open the app from its task's page" in sent[1]["body"]
    assert (b"set-cookie", b"hf_app_7=; Path=/apps/7/; Max-Age=0") in sent[0]["headers"]
    settings.HETEROFLOW_APP_HOST = "localhost:3333"
    assert run(proxy, scope("localhost:3333", "/portal/"))[0]["status"] == 404
    assert reached == [b"apps.example", b"portal.example"]


def test_the_cookie_is_the_tasks_untampered_and_within_its_life(settings):
    settings.HETEROFLOW_TUNNEL_MAX_SECONDS = 3600
    value = signing.dumps({"k": 7, "n": "n1", "p": 8123}, salt=app_proxy.COOKIE_SALT)
    assert app_proxy.read_cookie(scope("h", cookie=f"other=1; hf_app_7={value}"), 7)["p"] == 8123
    assert app_proxy.read_cookie(scope("h", cookie=f"hf_app_7={value}"), 8) is None  # another task's name
    assert app_proxy.read_cookie(scope("h", cookie=f"hf_app_8={value}"), 8) is None  # its body names task 7
    assert app_proxy.read_cookie(scope("h", cookie=f"hf_app_7={value[:-1]}x"), 7) is None
    with time_machine.travel(time.time() + 3601):
        assert app_proxy.read_cookie(scope("h", cookie=f"hf_app_7={value}"), 7) is None
    name, header = app_proxy.set_cookie(scope("h", scheme="https"), 7, {"k": 7})
    assert name == b"set-cookie" and b"Path=/apps/7/; HttpOnly; SameSite=Lax; Max-Age=3600; Secure" in header


def test_the_app_gets_the_browsers_headers_without_the_proxys_cookie_and_with_its_token():
    browser = scope(
        "7.apps.example",
        cookie="_xsrf=abc; hf_app_7=secret-pass; username-x=1",
        headers=[],
    )
    browser["headers"] = [
        (b"host", b"7.apps.example"),
        (b"cookie", b"_xsrf=abc; hf_app_7=secret-pass; sessionid=s; username-x=1; csrftoken=c"),
        (b"authorization", b"Bearer not-for-the-app"),
        (b"connection", b"keep-alive"),
        (b"accept", b"application/json"),
    ]
    headers = app_proxy.forwarded_headers(browser, "tok-1", 7)
    assert headers == [
        (b"host", b"7.apps.example"),
        (b"cookie", b"_xsrf=abc; username-x=1"),
        (b"accept", b"application/json"),
        (b"authorization", b"token tok-1"),
    ]


@pytest.mark.parametrize("task_id", [1, 42, 123456789])
def test_the_agent_serves_an_app_where_the_proxy_sends_it(task_id):
    assert base_url(task_id) == app_proxy.app_path(task_id)


def test_a_ticket_when_redis_is_away_is_503_not_a_server_error(settings, monkeypatch):
    """The ticket's nonce cannot be claimed: the person is told to retry, nothing else."""
    from apps.tunnel import entry

    settings.HETEROFLOW_APP_HOST = "apps.example"

    class Away:
        async def set(self, *args, **kwargs):
            raise ConnectionError("Redis is away")

    from apps.tunnel.api import routes

    monkeypatch.setattr(routes, "async_client", lambda: Away())
    monkeypatch.setattr(entry, "read_ticket", lambda ticket, task_id: {"n": "x", "u": 1})
    proxy = app_proxy.AppProxy(None)
    sent = run(proxy, {**scope("apps.example", "/apps/7/"), "query_string": b"hf_ticket=t"})
    assert sent[0]["status"] == 503 and b"Tickets cannot be checked now" in sent[1]["body"]
