"""The security headers (docs/security.md#headers): a Content-Security-Policy and a
Permissions-Policy on every HTML page (apps.core.middleware), Django's nosniff,
X-Frame-Options, Referrer-Policy and Cross-Origin-Opener-Policy everywhere, HSTS over
HTTPS only, the production settings `check --deploy` passes with; and the portal's
templates need nothing the policy forbids (no inline script, no event handler)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import AsyncClient, Client

from tests.headers import bearer

REPO = Path(__file__).resolve().parents[2]
PORTAL_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self'; connect-src 'self'; object-src 'none'; "
    "base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)
EVERYWHERE = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
}


def test_the_portal_pages_carry_the_policy_and_the_headers():
    response = Client().get("/portal/login/")
    assert response.status_code == 200
    assert response["Content-Security-Policy"] == PORTAL_POLICY
    assert response["Permissions-Policy"] == settings.HETEROFLOW_PERMISSIONS_POLICY
    assert {name: response.get(name) for name in EVERYWHERE} == EVERYWHERE
    assert "Strict-Transport-Security" not in response  # plain HTTP: never HSTS


@pytest.mark.django_db
def test_a_signed_in_page_and_the_admin_carry_the_policy(world):
    client = Client()
    client.force_login(world.operator)
    for url in ("/portal/", "/portal/nodes/"):
        response = client.get(url)
        assert response.status_code == 200, url
        assert response["Content-Security-Policy"] == PORTAL_POLICY, url
    # the admin's templates have inline <style> blocks: styles inline allowed, scripts not
    admin = client.get("/admin/")["Content-Security-Policy"]
    assert "script-src 'self';" in admin and "style-src 'self' 'unsafe-inline'" in admin


def test_the_policy_is_set_under_asgi_too():
    response = async_to_sync(AsyncClient().get)("/portal/login/")
    assert response["Content-Security-Policy"] == PORTAL_POLICY


@pytest.mark.django_db
def test_json_answers_get_the_headers_but_no_page_policy(world):
    response = Client().get("/api/v1/nodes", **bearer(world.operator_key))
    assert response.status_code == 200
    assert {name: response.get(name) for name in EVERYWHERE} == EVERYWHERE
    assert "Content-Security-Policy" not in response


def test_the_api_docs_page_gets_its_own_policy():
    response = Client().get("/api/docs/")
    assert response.status_code == 200
    assert response["Content-Security-Policy"] == settings.HETEROFLOW_CSP_BY_PATH["/api/docs/"]
    assert "frame-ancestors 'none'" in response["Content-Security-Policy"]


def test_hsts_over_https_when_it_is_configured(settings):
    settings.SECURE_HSTS_SECONDS = 31_536_000
    settings.SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    settings.SECURE_HSTS_PRELOAD = True
    secure = Client().get("/portal/login/", secure=True)
    assert secure["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains; preload"
    assert "Strict-Transport-Security" not in Client().get("/portal/login/")


INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>", re.I)
EVENT_HANDLER = re.compile(r"\son[a-z]+\s*=", re.I)
STYLE_BLOCK = re.compile(r"<style\b", re.I)


@pytest.mark.parametrize(
    "path",
    sorted(
        p.relative_to(REPO).as_posix()
        for p in [*(REPO / "templates" / "portal").rglob("*.html"), *(REPO / "templates").glob("*.html")]
    ),
    ids=str,
)
def test_no_template_needs_what_the_policy_forbids(path):
    text = (REPO / path).read_text()
    assert not INLINE_SCRIPT.search(text), f"{path}: an inline <script>; put it in static/ (CSP script-src 'self')"
    assert not EVENT_HANDLER.search(text), f"{path}: an on…= handler; use data-confirm / data-autosubmit (forms.js)"
    assert not STYLE_BLOCK.search(text), f"{path}: a <style> block; put it in static/portal/portal.css"
    assert "javascript:" not in text, f"{path}: a javascript: URL"


def manage(args):
    """manage.py in production mode with safe values (as tests/core/test_production_safety.py)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SECRET_KEY", "DEBUG", "ALLOWED_HOSTS", "HETEROFLOW_"))
    }
    env.update(
        HETEROFLOW_ENV="production",
        SECRET_KEY=secrets.token_urlsafe(50),
        HETEROFLOW_AGENT_SECRET=secrets.token_urlsafe(24),
        ALLOWED_HOSTS="hf.example.com",
    )
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_production_settings_are_secure_and_pass_check_deploy():
    result = manage(["check", "--deploy", "--fail-level", "WARNING"])
    assert result.returncode == 0, result.stdout + result.stderr
    shown = manage(
        [
            "shell",
            "--no-imports",
            "-c",
            "from django.conf import settings as s; print(s.SECURE_HSTS_SECONDS, s.SECURE_SSL_REDIRECT, "
            "s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_CONTENT_TYPE_NOSNIFF, s.X_FRAME_OPTIONS, "
            "s.SECURE_REFERRER_POLICY, 'apps.core.middleware.SecurityHeadersMiddleware' in s.MIDDLEWARE)",
        ]
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip().splitlines()[-1].split() == [
        "31536000",
        "True",
        "True",
        "True",
        "True",
        "DENY",
        "same-origin",
        "True",
    ]
