"""Alert pages: reads through apps.alerts.selectors (scoped by Alert.objects.visible_to:
node and GPU alerts are for operators), changes through apps.alerts.services."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from apps.alerts.choices import AlertScope, AlertState, AlertType, Severity
from apps.alerts.models import Alert
from apps.alerts.selectors import alert_list as alerts_for
from apps.alerts.selectors import alert_stats
from apps.alerts.services import acknowledge_alert, resolve_alert
from apps.core.views import get_visible_or_404
from apps.portal.access import portal_page
from apps.portal.pages.common import choice, paginate
from apps.tenants.policy import may_resolve_alert

# the rows an alert's page reads (each lookup narrows them to the principal's scope)
ALERTS = Alert.objects.select_related("task", "tenant")


@portal_page
def alert_list(request):
    principal = request.principal
    acknowledged = {"yes": True, "no": False}.get(request.GET.get("acknowledged", ""))
    filters = {
        "state": choice(request.GET.get("state", ""), AlertState.values),
        "severity": choice(request.GET.get("severity", ""), Severity.values),
        "type": choice(request.GET.get("type", ""), AlertType.values),
        "scope": choice(request.GET.get("scope", ""), AlertScope.values),
    }
    alerts = alerts_for(principal, acknowledged=acknowledged, **filters).select_related("task", "tenant")
    return render(
        request,
        "portal/alerts.html",
        {
            "page": paginate(request, alerts, 50),
            "filters": filters,
            "acknowledged": request.GET.get("acknowledged", ""),
            "stats": alert_stats(principal),
            "states": AlertState.values,
            "severities": Severity.values,
            "types": AlertType.values,
            "scopes": AlertScope.values,
        },
    )


@portal_page
def alert_detail(request, pk):
    alert = get_visible_or_404(ALERTS, request.principal, pk=pk)
    return render(
        request,
        "portal/alert_detail.html",
        {"alert": alert, "may_resolve": may_resolve_alert(request.principal, alert)},
    )


@require_POST
@portal_page
def alert_acknowledge(request, pk):
    alert = get_visible_or_404(ALERTS, request.principal, pk=pk)
    if acknowledge_alert(alert, request.user):
        messages.success(request, "Acknowledged.")
    else:
        messages.info(request, "Nothing to acknowledge: it is acknowledged already, or no longer active.")
    return redirect("portal:alert", alert.pk)


@require_POST
@portal_page
def alert_resolve(request, pk):
    alert = get_visible_or_404(ALERTS, request.principal, pk=pk)
    if not may_resolve_alert(request.principal, alert):
        raise PermissionDenied("Only platform operators and tenant admins can resolve alerts.")
    if resolve_alert(alert, request.user):
        messages.success(request, "Resolved.")
    else:
        messages.info(request, f"Nothing to resolve: the alert is {alert.state}.")
    return redirect("portal:alert", alert.pk)
