from django.db import models
from django.db.models import Q

from apps.alerts.choices import AlertState, AlertType, Severity


class Alert(models.Model):
    """An alert. The alerts issue adds the sweep, channels and API; the foundation of
    raising and recovering lives here so that producers (nodes, GPUs) can use it."""

    type = models.CharField(max_length=32, choices=AlertType.choices)
    severity = models.CharField(max_length=10, choices=Severity.choices)
    state = models.CharField(max_length=10, choices=AlertState.choices, default=AlertState.ACTIVE)
    # de-duplication: at most one ACTIVE alert per key
    key = models.CharField(max_length=200)
    node_id = models.CharField(max_length=128, blank=True, default="", db_index=True)
    gpu_index = models.IntegerField(null=True, blank=True)
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="alerts")
    message = models.TextField()
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "alerts"
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["key"], condition=Q(state="ACTIVE"), name="alert_one_active_per_key")
        ]

    def __str__(self):
        return f"{self.type} {self.key} ({self.state})"
