"""Signing in with the company's identity in a real browser (Chromium, Playwright) against a
real OpenID provider (npm's oidc-provider, scripts/oidc-provider.sh): the "Sign in with"
button, the provider's sign-in and consent pages, back to the portal in the tenant and role
the mapping gives, and out again through the provider's logout (RP-initiated). The
control plane runs with HETEROFLOW_LOCAL_SIGN_IN=false, so the same module pins the folded
local form: a member's password no longer works, a break-glass operator's does.

Also: a group change takes effect at the next sign-in; a person with no mapped group gets
the refusal page (403, audited); the provider's answer replayed (the same state and code)
is refused."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model

from apps.core.models import OperatorAuditEvent
from apps.identity.models import GroupMapping
from apps.tenants.services import add_member, create_tenant
from tests.factories import OperatorFactory, UserFactory
from tests.identity.providers import oidc_provider, oidc_settings, set_oidc_people
from tests.portal.browser.support import (  # skips this module without a browser
    PASSWORD,
    SCREENSHOTS,
    WAIT_MS,
    committed,
    live_portal,
    sync_api,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db]
expect = sync_api.expect
User = get_user_model()
# logins of this module only: the provider is shared by the test run
ALICE, BOB = "idb-alice", "idb-bob"


def seed_world() -> None:
    acme = create_tenant(name="Acme Research", slug="acme")
    GroupMapping.objects.create(group="acme-users", tenant=acme, role="member")
    GroupMapping.objects.create(group="acme-leads", tenant=acme, role="admin")
    OperatorFactory(username="break-glass", password=PASSWORD)
    UserFactory(username="local-dev", password=PASSWORD)
    add_member(acme, username="local-dev", role="member")


@pytest.fixture(scope="module")
def provider():
    provider = oidc_provider()
    set_oidc_people(provider, {ALICE: {"groups": ["acme-users", "unrelated"]}, BOB: {"groups": ["marketing"]}})
    return provider


@pytest.fixture(scope="module")
def live(django_db_setup, django_db_blocker, provider):
    env = {**oidc_settings(provider), "HETEROFLOW_LOCAL_SIGN_IN": "false"}
    with django_db_blocker.unblock(), live_portal(lambda url: committed(seed_world), env=env) as world:
        yield world


@pytest.fixture
def page(live):
    context = live["browser"].new_context(viewport={"width": 1280, "height": 900}, base_url=live["url"])
    context.set_default_timeout(WAIT_MS)
    yield context.new_page()
    context.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"identity-{name}.png"), full_page=True)


def sign_in_at_provider(page, login: str, callbacks: list | None = None) -> None:
    """From the portal's sign-in page through the provider's pages, back to HeteroFlow."""
    if callbacks is not None:
        page.on("request", lambda request: "/identity/oidc/" in request.url and callbacks.append(request.url))
    page.goto("/portal/login/")
    page.click("text=Sign in with Corp SSO")
    page.fill("input[name=login]", login)
    page.fill("input[name=password]", "any")
    page.click("button:text('Sign-in')")
    page.click("button:text('Continue')")  # the provider's consent page


def me(page) -> dict:
    response = page.request.get("/api/v1/me")
    assert response.status == 200, response.text()
    return response.json()


def test_sign_in_lands_in_the_mapped_tenant_and_role_and_sign_out_leaves_the_provider_too(page, live):
    sign_in_at_provider(page, ALICE)
    expect(page.locator("#status-bar")).to_be_visible()
    shot(page, "signed-in")
    who = me(page)
    assert (who["username"], who["tenant"], who["role"]) == (ALICE, "acme", "member")

    page.click('nav.menus summary:text-is("Account")')
    page.click(f"button:text('Sign out {ALICE}')")
    # RP-initiated logout: the provider asks, then sends the browser back to the sign-in page
    page.click("button:text('Yes, sign me out')")
    expect(page).to_have_url(re.compile(re.escape(f"{live['url']}/portal/login/") + r"(\?state=\S+)?$"))
    assert page.request.get("/api/v1/me").status in (401, 403)


def test_a_group_change_takes_effect_at_the_next_sign_in(page, live, provider):
    set_oidc_people(provider, {ALICE: {"groups": ["acme-leads"]}})
    try:
        sign_in_at_provider(page, ALICE)
        expect(page.locator("#status-bar")).to_be_visible()
        assert me(page)["role"] == "admin"
    finally:
        set_oidc_people(provider, {ALICE: {"groups": ["acme-users", "unrelated"]}})


def test_a_person_with_no_mapped_group_is_refused_with_a_page_and_audited(page, live):
    responses = []
    page.on("response", lambda response: "/callback" in response.url and responses.append(response.status))
    sign_in_at_provider(page, BOB)
    expect(page.locator("#sign-in-refused")).to_contain_text("None of your directory groups")
    shot(page, "refused")
    assert responses == [403]
    assert page.request.get("/api/v1/me").status in (401, 403)
    refused = committed(lambda: list(OperatorAuditEvent.objects.filter(action="identity.sign_in_refused", target=BOB)))
    assert refused and refused[0].details["groups"] == ["marketing"]
    assert not committed(lambda: User.objects.filter(username=BOB).exists())


def test_the_providers_answer_replayed_is_refused(page, live):
    callbacks = []
    sign_in_at_provider(page, ALICE, callbacks)
    expect(page.locator("#status-bar")).to_be_visible()
    answer = next(url for url in callbacks if "/callback?" in url)
    assert "state=" in answer and "code=" in answer
    replay = page.goto(answer)
    assert replay.status == 400
    expect(page.locator("#sign-in-refused")).to_contain_text("failed")


def test_with_the_local_form_off_only_a_break_glass_operator_signs_in_with_a_password(page, live):
    page.goto("/portal/login/")
    expect(page.locator("#id_username")).to_be_hidden()  # folded away
    page.click("#break-glass summary")
    page.fill("#id_username", "local-dev")
    page.fill("#id_password", PASSWORD)
    page.click("#break-glass button[type=submit]")
    expect(page.locator(".error")).to_contain_text("did not match")
    shot(page, "local-form-off")

    page.fill("#id_username", "break-glass")
    page.fill("#id_password", PASSWORD)
    page.click("#break-glass button[type=submit]")
    expect(page.locator("#status-bar")).to_be_visible()
    assert me(page)["kind"] == "operator"
