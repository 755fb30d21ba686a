"""The portal's menu (apps/portal/navigation.py, templates/portal/base.html): the pages in
a few groups, each link only for who may open its page, the page being looked at marked
with aria-current on its link and on the group that holds it; every page of the portal
belongs to a link of the menu."""

import re

import pytest
from django.urls import URLPattern, reverse

from apps.portal import urls as portal_urls
from apps.portal.navigation import MENU, Group, current_url
from tests.portal.client import page, signed_in

pytestmark = pytest.mark.django_db

GROUPS = {
    "fleet": ["Nodes", "Monitor", "GPU health", "Environment", "Slices", "Energy"],
    "work": ["Tasks", "Queues", "Estimate accuracy", "Simulations", "Training", "Inference", "Models"],
    "serving": ["Endpoint keys", "Usage"],
    "account": ["API keys", "Members", "Admin"],
}


def nav(html: str) -> str:
    found = re.search(r'<nav class="menus" aria-label="Portal">.*?</nav>', html, re.S)
    assert found, "no menu on the page"
    return found.group(0)


def menu_of(html: str) -> dict:
    """{"": [top-level links], group key: [its links]} as rendered."""
    menu = nav(html)
    groups = {
        key: re.findall(r"<a href=\"[^\"]+\"[^>]*>([^<]+)</a>", body)
        for key, body in re.findall(r'<details class="menu[^"]*" data-menu="([a-z]+)">(.*?)</details>', menu, re.S)
    }
    top = re.findall(r'<a class="top" href="[^"]+"[^>]*>([^<]+)</a>', menu)
    return {"": top, **groups}


def marked(html: str) -> tuple[list, list]:
    """(the groups marked current, the links marked as this page)."""
    menu = nav(html)
    groups = re.findall(r'data-menu="([a-z]+)">\s*<summary aria-current="true">', menu)
    links = re.findall(r'aria-current="page">([^<]+)</a>', menu)
    return groups, links


def test_each_role_sees_the_groups_and_only_the_links_it_may_follow(client, world):
    everything = {"": ["Dashboard", "Alerts"], **GROUPS}
    assert menu_of(page(signed_in(client, world.operator), "/portal/")) == everything
    operators_only = {"Estimate accuracy", "Simulations"}
    people = everything | {"work": [link for link in GROUPS["work"] if link not in operators_only]}
    tenant_admin = menu_of(page(signed_in(client, world.users["acme-admin"]), "/portal/"))
    assert tenant_admin == people | {"account": ["API keys", "Members"]}  # no Django admin: not staff
    for role in ("acme-member", "acme-viewer"):
        html = page(signed_in(client, world.users[role]), "/portal/")
        assert menu_of(html) == people | {"account": ["API keys"]}, role
        assert 'href="/portal/members/"' not in nav(html) and 'href="/admin/"' not in nav(html)
        assert f"Sign out {world.users[role].username}" in nav(html)  # in the account group


@pytest.mark.parametrize(
    ("url", "group", "link"),
    [
        ("/portal/", None, "Dashboard"),
        ("/portal/nodes/", "fleet", "Nodes"),
        ("/portal/nodes/shared-1/", "fleet", "Nodes"),
        ("/portal/nodes/monitor/", "fleet", "Monitor"),
        ("/portal/nodes/gpu-health/", "fleet", "GPU health"),
        ("/portal/environment/", "fleet", "Environment"),
        ("/portal/slices/", "fleet", "Slices"),
        ("/portal/energy/", "fleet", "Energy"),
        ("/portal/tasks/", "work", "Tasks"),
        ("/portal/tasks/new/", "work", "Tasks"),
        ("/portal/queues/", "work", "Queues"),
        ("/portal/queues/estimates/", "work", "Estimate accuracy"),
        ("/portal/queues/simulations/", "work", "Simulations"),
        ("/portal/training/new/", "work", "Training"),
        ("/portal/inference/", "work", "Inference"),
        ("/portal/models/new/", "work", "Models"),
        ("/portal/endpoint-keys/", "serving", "Endpoint keys"),
        ("/portal/gateway-usage/", "serving", "Usage"),
        ("/portal/alerts/", None, "Alerts"),
        ("/portal/keys/", "account", "API keys"),
        ("/portal/members/", "account", "Members"),
    ],
)
def test_the_page_is_marked_on_its_link_and_on_its_group(client, world, cluster, url, group, link):
    html = page(signed_in(client, world.operator), url)
    assert marked(html) == ([group] if group else [], [link])
    if group:
        assert f'<details class="menu current" data-menu="{group}">' in nav(html)
    assert nav(html).count("menu current") == (1 if group else 0)


def test_a_page_another_role_has_no_link_to_marks_nothing(client, world):
    """A member opening the members page (403) is shown no link of it, and nothing else
    is claimed to be the page."""
    response = signed_in(client, world.users["acme-member"]).get("/portal/members/")
    assert response.status_code == 403
    assert current_url("/portal/members/", ["/portal/", "/portal/keys/"]) is None


NOT_PAGES = {"login", "logout", "switch-tenant", "server-hosts", "node-cards"}  # sign-in, POSTs and JSON reads


def sample_path(pattern: URLPattern) -> str:
    """The pattern's address with a sample value for each of its parameters."""
    samples = {"IntConverter": 1, "StringConverter": "n1", "SlugConverter": "utilisation"}
    arguments = {name: samples[type(converter).__name__] for name, converter in pattern.pattern.converters.items()}
    return reverse(f"portal:{pattern.name}", kwargs=arguments)


def test_every_portal_page_belongs_to_a_link_of_the_menu():
    """A page added without a menu entry fails here (docs/portal.md, Adding a page)."""
    urls = [link.url() for entry in MENU for link in (entry.links if isinstance(entry, Group) else (entry,))]
    pages = [p for p in portal_urls.urlpatterns if p.name not in NOT_PAGES]
    assert len(pages) > 40
    orphans = [sample_path(p) for p in pages if current_url(sample_path(p), urls) is None]
    assert orphans == []
    assert {p.name for p in portal_urls.urlpatterns} >= NOT_PAGES  # the exceptions are real names


def test_the_longest_address_wins_and_the_dashboard_is_only_itself():
    urls = ["/portal/", "/portal/nodes/", "/portal/nodes/monitor/", "/portal/tasks/"]
    assert current_url("/portal/nodes/monitor/", urls) == "/portal/nodes/monitor/"
    assert current_url("/portal/nodes/gpu-7/", urls) == "/portal/nodes/"
    assert current_url("/portal/", urls) == "/portal/"
    assert current_url("/portal/login/", urls) is None
    assert current_url("/portal/tasksets/", urls) is None  # a prefix is a whole path segment
