"""LDAP sign-in in a real browser: the portal's sign-in form, a real slapd behind it
(scripts/ldap.sh, StartTLS only, its own CA), the person's directory groups mapped to a
tenant and a role. One flow: in with the directory's password, in the tenant as its
admin, out again."""

from __future__ import annotations

import pytest

from apps.identity.models import GroupMapping
from apps.tenants.services import create_tenant
from tests.identity.providers import ldap_directory, ldap_group_dn, ldap_settings
from tests.portal.browser.support import SCREENSHOTS, WAIT_MS, committed, live_portal, sync_api

pytestmark = [pytest.mark.browser, pytest.mark.django_db]
expect = sync_api.expect


@pytest.fixture(scope="module")
def directory():
    return ldap_directory()


@pytest.fixture(scope="module")
def live(django_db_setup, django_db_blocker, directory):
    def seed_world():
        acme = create_tenant(name="Acme Research", slug="acme")
        GroupMapping.objects.create(group=ldap_group_dn(directory, "gpu-users"), tenant=acme, role="member")
        GroupMapping.objects.create(group=ldap_group_dn(directory, "gpu-admins"), tenant=acme, role="admin")

    env = {**ldap_settings(directory), "HETEROFLOW_LOCAL_SIGN_IN": "false"}
    with django_db_blocker.unblock(), live_portal(lambda url: committed(seed_world), env=env) as world:
        yield world


def test_a_directory_person_signs_in_over_starttls_as_the_mapped_admin_and_out(live):
    context = live["browser"].new_context(viewport={"width": 1280, "height": 900}, base_url=live["url"])
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    try:
        page.goto("/portal/login/")
        # local passwords are off, but the form stays for the directory's
        page.fill("#id_username", "erin")
        page.fill("#id_password", "erin-pw")
        page.click("button[type=submit]")
        expect(page.locator("#status-bar")).to_be_visible()
        page.screenshot(path=str(SCREENSHOTS / "identity-ldap-signed-in.png"), full_page=True)
        who = page.request.get("/api/v1/me").json()
        assert (who["username"], who["tenant"], who["role"]) == ("erin", "acme", "admin")
        page.click('nav.menus summary:text-is("Account")')
        page.click("button:text('Sign out erin')")
        expect(page).to_have_url(f"{live['url']}/portal/login/")
        assert page.request.get("/api/v1/me").status in (401, 403)
    finally:
        context.close()
