"""Who is looking at a portal page, and the status bar every page shows.

Pages use the same principal as the API's session authentication
(`principal_for_session`), so a page and the API agree on what a user may see."""

from __future__ import annotations

from functools import wraps

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from rest_framework import exceptions as api_errors

from apps.alerts.selectors import alert_stats
from apps.core.authentication import principal_for_session
from apps.nodes.selectors import gpus_online
from apps.tasks.choices import TaskStatus
from apps.tasks.models import Task


def portal_page(view):
    """Signed-in users only (anonymous visitors go to the sign-in page); the view finds
    the principal in `request.principal`. A refusal raised the API's way (a tenant header
    naming a tenant not theirs, a rule of apps.tenants.policy) is the page's 403, with
    the same words."""

    @login_required
    @wraps(view)
    def wrapped(request, *args, **kwargs):
        try:
            request.principal = principal_for_session(request, request.user)
            return view(request, *args, **kwargs)
        except api_errors.PermissionDenied as exc:
            raise PermissionDenied(str(exc.detail)) from None

    return wrapped


def operators_only(view):
    """Pages and actions for platform operators; others get 403 (the page exists for
    everyone, the action is refused), as the API's IsOperator does."""

    @wraps(view)
    def wrapped(request, *args, **kwargs):
        if not request.principal.is_operator:
            raise PermissionDenied("Only platform operators can do this.")
        return view(request, *args, **kwargs)

    return wrapped


def status_bar(principal) -> dict:
    """GPUs online, tasks running, active alerts: narrowed to what the principal sees."""
    return {
        "gpus_online": gpus_online(principal),
        "tasks_running": Task.objects.visible_to(principal).filter(status=TaskStatus.RUNNING).count(),
        "alerts_active": alert_stats(principal)["active"],
    }
