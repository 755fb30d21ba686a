"""Reads of alerts shared by the API and the pages. Scoping is Alert.objects.visible_to."""

from __future__ import annotations

from django.db.models import Count

from apps.alerts.choices import AlertState
from apps.alerts.models import Alert


def alert_list(
    principal,
    *,
    state: str = "",
    type: str = "",
    severity: str = "",
    scope: str = "",
    node_id: str = "",
    task_id: int | None = None,
    since=None,
    until=None,
    acknowledged: bool | None = None,
):
    alerts = Alert.objects.visible_to(principal)
    for field, value in (
        ("state", state),
        ("type", type),
        ("severity", severity),
        ("scope", scope),
        ("node_id", node_id),
    ):
        if value:
            alerts = alerts.filter(**{field: value})
    if task_id is not None:
        alerts = alerts.filter(task_id=task_id)
    if since is not None:
        alerts = alerts.filter(created_at__gte=since)
    if until is not None:
        alerts = alerts.filter(created_at__lt=until)
    if acknowledged is not None:
        alerts = alerts.filter(acknowledged_at__isnull=not acknowledged)
    return alerts


def alert_stats(principal) -> dict:
    """Counts the status bar and the alert pages show: active alerts by severity and
    type, and all alerts by state, narrowed to what the principal may see."""
    alerts = Alert.objects.visible_to(principal)
    by_state = dict(alerts.order_by().values_list("state").annotate(n=Count("id")))
    active = alerts.filter(state=AlertState.ACTIVE).order_by()
    return {
        "active": by_state.get(AlertState.ACTIVE, 0),
        "by_state": {state: by_state.get(state, 0) for state in AlertState.values},
        "active_by_severity": dict(active.values_list("severity").annotate(n=Count("id"))),
        "active_by_type": dict(active.values_list("type").annotate(n=Count("id"))),
        "active_unacknowledged": active.filter(acknowledged_at__isnull=True).count(),
    }
