"""What the browser tests share: Chromium and Playwright (a test module that imports this
is skipped where either is missing), the constants, and the helpers that commit data the
live control plane sees."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

CHROMIUM = os.environ.get("HETEROFLOW_CHROMIUM", "/usr/bin/chromium")
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -r requirements/dev.txt)"
)
if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"no Chromium at {CHROMIUM} (apt-get install -y chromium; .ci/run installs it)", allow_module_level=True
    )

from django.contrib.contenttypes.models import ContentType  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, connections  # noqa: E402

from apps.inference.models import InferenceService  # noqa: E402
from apps.nodes.models import Node  # noqa: E402
from apps.tasks.models import Task  # noqa: E402
from apps.tenants.models import Tenant  # noqa: E402
from tests.headers import AGENT_HTTP  # noqa: E402
from tests.live import start_control_plane, stop_process  # noqa: E402
from tests.nodes.image_support import seed_default_watched_images  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SCREENSHOTS = REPO / "test-artefacts" / "screenshots"
PASSWORD = "pw-for-browser-tests"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--disable-dev-shm-usage",
]  # containers often have a small /dev/shm
WAIT_MS = 10_000  # the longest any single expectation waits


def committed(function, *args, **kwargs):
    """Run `function` on a connection of its own (a thread's), so its writes commit and
    the server sees them."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections

    def run():
        try:
            return function(*args, **kwargs)
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


def beat(url: str, node_id: str, payload: dict) -> None:
    response = requests.post(f"{url}/api/v1/nodes/{node_id}/heartbeat", json=payload, headers=AGENT_HTTP, timeout=10)
    assert response.status_code == 200, response.text


@contextmanager
def live_portal(seed: Callable[[str], dict | None], *, env: dict | None = None) -> Iterator[dict]:
    """A browser module's world: a control plane on the test database (tests/live.py), the
    data `seed(url)` commits, and Chromium. Yields {"url", "browser", "servers"} and what
    `seed` returned; a test that restarts the server appends the new one to "servers".
    Afterwards the last server stops and the database is cleaned, however the module
    ended. Run it with the database unblocked (django_db_blocker.unblock())."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    server, url = start_control_plane(env=env)
    servers = [server]
    # Playwright's sync API keeps an event loop in this thread; the tests' own database
    # calls are plain synchronous ones between browser steps (set after the server
    # started: it must not inherit this)
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        seeded = seed(url) or {}
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield {"url": url, "browser": browser, "servers": servers, **seeded}
            finally:
                browser.close()
                # while Playwright's loop runs, Django keeps the tests' connection apart
                # from this thread's own: close it, or it outlives the run
                connections.close_all()
    finally:
        stop_process(servers[-1])
        clean_database()
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


def clean_database() -> None:
    """Remove what the module committed: tenants through the ORM (which drops their
    schemas), then every public table, as a transactional test's teardown does (the live
    log lines with them: tests/flush.py); then what the migrations seed, again."""
    InferenceService.objects.all().delete()  # a service holds its model: first
    Task.objects.all().delete()
    Node.objects.all().delete()
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM node_metrics")
    for tenant in Tenant.objects.all():
        tenant.delete(force_drop=True)
    call_command("flush", interactive=False, verbosity=0)  # post_migrate puts the content types back
    ContentType.objects.clear_cache()
    seed_default_watched_images()


def follow_menu(page, group: str, link: str) -> None:
    """Go to a page the way a person does: open the menu's group, click the link."""
    page.click(f'nav.menus summary:text-is("{group}")')
    page.click(f'nav.menus details[open] .menu-items a:text-is("{link}")')


class Browser:
    """A signed-in context (`live`: the module's {"url", "browser"}) that records every
    CSP violation the browser reports."""

    def __init__(self, live, username):
        self.context = live["browser"].new_context(viewport={"width": 1360, "height": 900}, base_url=live["url"])
        self.context.set_default_timeout(WAIT_MS)
        self.page = self.context.new_page()
        self.violations: list[str] = []
        self.page.on("console", self._console)
        self.page.goto("/portal/login/")
        self.page.fill("#id_username", username)
        self.page.fill("#id_password", PASSWORD)
        self.page.click("button[type=submit]")
        sync_api.expect(self.page.locator("#status-bar")).to_be_visible()

    def _console(self, message):
        if "Content Security Policy" in message.text or "Content-Security-Policy" in message.text:
            self.violations.append(f"{self.page.url}: {message.text}")

    def close(self):
        self.context.close()
