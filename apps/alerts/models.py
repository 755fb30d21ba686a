from django.conf import settings
from django.db import models
from django.db.models import Q

from apps.alerts.choices import TENANT_VISIBLE_SCOPES, AlertScope, AlertState, AlertType, Severity
from apps.core.scoping import ScopedQuerySet


class AlertQuerySet(ScopedQuerySet):
    def visible_to(self, principal):
        """Operators see every alert; a tenant's people see the alerts of their own
        tasks and of their tenant (quota), never node or GPU alerts: a node belongs to
        no tenant, and its troubles would tell one tenant about another's work."""
        alerts = super().visible_to(principal)
        if principal is not None and principal.is_tenant:
            alerts = alerts.filter(scope__in=TENANT_VISIBLE_SCOPES)
        return alerts


class Alert(models.Model):
    """Raised by services (apps.alerts.services.raise_alert) and by the heartbeat's own
    statement (GPU_LOST); at most one ACTIVE alert per key, so raising is idempotent."""

    type = models.CharField(max_length=32, choices=AlertType.choices)
    severity = models.CharField(max_length=10, choices=Severity.choices)
    scope = models.CharField(max_length=10, choices=AlertScope.choices, db_default=AlertScope.NODE)
    state = models.CharField(max_length=10, choices=AlertState.choices, default=AlertState.ACTIVE)
    # de-duplication: at most one ACTIVE alert per key
    key = models.CharField(max_length=200)
    node_id = models.CharField(max_length=128, blank=True, default="", db_index=True)
    gpu_index = models.IntegerField(null=True, blank=True)
    task = models.ForeignKey("tasks.Task", null=True, blank=True, on_delete=models.SET_NULL, related_name="alerts")
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="alerts")
    message = models.TextField()
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    ended_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    objects = AlertQuerySet.as_manager()

    class Meta:
        db_table = "alerts"
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["state", "-created_at"], name="alerts_by_state"),
            models.Index(fields=["tenant", "state", "-created_at"], name="alerts_by_tenant"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["key"], condition=Q(state="ACTIVE"), name="alert_one_active_per_key")
        ]

    def __str__(self):
        return f"{self.type} {self.key} ({self.state})"
