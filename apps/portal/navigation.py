"""The portal's menu: a few groups of pages (the fleet, work, serving, the account) and
two links of their own (the dashboard, alerts). Each link is shown only to who may open
its page; the page being looked at is marked, and so is the group that holds it.
`templates/portal/base.html` renders what `menu()` returns; a new page joins the menu
with one `Link` here (docs/portal.md, "Adding a page")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.urls import reverse


def everyone(request) -> bool:
    return True


def tenant_admins_and_operators(request) -> bool:
    """The members page answers 403 to the others (apps/portal/pages/account.py)."""
    principal = request.principal
    return principal.is_tenant_admin or principal.is_operator


def operators(request) -> bool:
    """Operators' pages answer 403 to the others (apps.portal.access.operators_only)."""
    return request.principal.is_operator


def staff(request) -> bool:
    """Django's admin lets staff users in, nobody else."""
    return request.user.is_staff


@dataclass(frozen=True)
class Link:
    label: str
    target: str  # a URL name ("portal:nodes") or, for a page outside the portal, its path
    shown: Callable = everyone

    def url(self) -> str:
        return self.target if self.target.startswith("/") else reverse(self.target)


@dataclass(frozen=True)
class Group:
    key: str
    label: str
    links: tuple[Link, ...]


MENU: tuple[Link | Group, ...] = (
    Link("Dashboard", "portal:home"),
    Group(
        "fleet",
        "Fleet",
        (
            Link("Nodes", "portal:nodes"),
            Link("Monitor", "portal:node-monitor"),
            Link("GPU health", "portal:gpu-health"),
            Link("Environment", "portal:environment"),
            Link("Slices", "portal:slices"),
            Link("Energy", "portal:energy"),
        ),
    ),
    Group(
        "work",
        "Work",
        (
            Link("Tasks", "portal:tasks"),
            Link("Queues", "portal:queues"),
            Link("Estimate accuracy", "portal:prediction-accuracy", operators),
            Link("Simulations", "portal:simulations", operators),
            Link("Training", "portal:training"),
            Link("Inference", "portal:inference"),
            Link("Models", "portal:models"),
        ),
    ),
    Group("serving", "Serving", (Link("Endpoint keys", "portal:endpoint-keys"), Link("Usage", "portal:gateway-usage"))),
    Link("Alerts", "portal:alerts"),
    Group(
        "account",
        "Account",
        (
            Link("API keys", "portal:keys"),
            Link("Members", "portal:members", tenant_admins_and_operators),
            Link("Admin", "/admin/", staff),
        ),
    ),
)


def current_url(path: str, urls: list[str]) -> str | None:
    """The link a page belongs to: the longest link address its path starts with (a
    node's page is under Nodes, /portal/nodes/monitor/ is Monitor's own). The dashboard's
    address is the start of every page's, so it is current only for itself."""
    home = reverse("portal:home")
    matching = [url for url in urls if path == url or (url != home and path.startswith(url))]
    return max(matching, key=len, default=None)


def menu(request) -> list[dict]:
    """The menu as `request`'s user sees it: each entry a link ({"label", "url",
    "current"}) or a group ({"key", "label", "links", "current"}) of the links its user
    may follow; a group left with none is left out."""
    entries = []
    for entry in MENU:
        links = entry.links if isinstance(entry, Group) else (entry,)
        shown = [{"label": link.label, "url": link.url()} for link in links if link.shown(request)]
        if shown:
            entries.append((entry, shown))
    current = current_url(request.path, [link["url"] for _, shown in entries for link in shown])
    rendered = []
    for entry, shown in entries:
        for link in shown:
            link["current"] = link["url"] == current
        if isinstance(entry, Group):
            rendered.append(
                {"key": entry.key, "label": entry.label, "links": shown, "current": any(x["current"] for x in shown)}
            )
        else:
            rendered.append(shown[0])
    return rendered
