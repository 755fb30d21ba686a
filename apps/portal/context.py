"""Template context for every portal page: the principal, the tenants the user may
switch between, the menu, and the status bar (each computed only when a page shows it)."""

from django.utils.functional import SimpleLazyObject

from apps.portal.access import status_bar
from apps.portal.navigation import menu


def portal(request):
    principal = getattr(request, "principal", None)
    if principal is None:
        return {}
    return {
        "principal": principal,
        "memberships": SimpleLazyObject(lambda: list(request.user.memberships.by_tenant_name())),
        "status": SimpleLazyObject(lambda: status_bar(principal)),
        "menu": SimpleLazyObject(lambda: menu(request)),
    }
