from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from apps.alerts.choices import (
    TENANT_VISIBLE_SCOPES,
    AlertScope,
    AlertState,
    AlertType,
    ChannelKind,
    DeliveryStatus,
    NotificationEvent,
    Severity,
)
from apps.confidential.models import ChannelCredentials
from apps.core.models import TenantOwned
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


class Alert(TenantOwned):
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
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # The notification outbox (apps.alerts.notifications.dispatch): when the dispatcher
    # took this alert's "raised" and "ended" events. NULL: not yet.
    dispatched_raised_at = models.DateTimeField(null=True, blank=True)
    dispatched_ended_at = models.DateTimeField(null=True, blank=True)

    objects = AlertQuerySet.as_manager()

    class Meta:
        db_table = "alerts"
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["state", "-created_at"], name="alerts_by_state"),
            models.Index(fields=["tenant", "state", "-created_at"], name="alerts_by_tenant"),
            # what the notification dispatcher still has to take
            models.Index(
                fields=["id"], condition=Q(dispatched_raised_at__isnull=True), name="alerts_to_dispatch_raised"
            ),
            models.Index(
                fields=["id"],
                condition=Q(dispatched_ended_at__isnull=True) & ~Q(state=AlertState.ACTIVE),
                name="alerts_to_dispatch_ended",
            ),
        ]
        constraints = [
            models.UniqueConstraint(fields=["key"], condition=Q(state="ACTIVE"), name="alert_one_active_per_key")
        ]

    def __str__(self):
        return f"{self.type} {self.key} ({self.state})"


# --- notification channels (apps.alerts.notifications) ------------------------------------


class NotificationChannelQuerySet(ScopedQuerySet):
    """Operators see every channel; a tenant's people see their tenant's channels only
    (the operators' channels, tenant NULL, belong to no tenant)."""

    tenant_field = "tenant"


class NotificationChannel(TenantOwned):
    """Where alerts are sent. A tenant's channel receives the alerts its tenant may see
    (Alert.objects.visible_to); an operators' channel (tenant NULL) receives every alert.
    A webhook's URL and signing secret are credentials, never in this table: a tenant's
    live in its schema (apps.confidential ChannelSecret), the operators' in
    OperatorChannelSecret."""

    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="notification_channels"
    )
    name = models.CharField(max_length=100)
    kind = models.CharField(max_length=10, choices=ChannelKind.choices)
    recipients = ArrayField(models.EmailField(), default=list, blank=True)  # e-mail channels
    # filters: an alert is sent when its severity is at least min_severity and its type is
    # in types (empty: every type)
    min_severity = models.CharField(max_length=10, choices=Severity.choices, default=Severity.INFO)
    types = ArrayField(models.CharField(max_length=32, choices=AlertType.choices), default=list, blank=True)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    updated_at = models.DateTimeField(auto_now=True)
    # delivery health: permanent failures only (a retry that later succeeds is not one)
    last_success_at = models.DateTimeField(null=True, blank=True)
    last_failure_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True, default="")
    consecutive_failures = models.PositiveIntegerField(default=0)

    objects = NotificationChannelQuerySet.as_manager()

    class Meta:
        db_table = "alert_channels"
        ordering = ["name", "id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="alert_channel_name_per_tenant"),
            models.UniqueConstraint(
                fields=["name"], condition=Q(tenant__isnull=True), name="alert_channel_name_operators"
            ),
        ]

    def __str__(self):
        return f"{self.name} ({self.kind}, {self.tenant.slug if self.tenant_id else 'operators'})"


class NotificationDelivery(models.Model):
    """One event sent to one channel: created by the dispatcher (or a test request), sent
    by the alerts.deliver_notification job, retried with back-off. One per (alert,
    event, channel), so an event never reaches a channel twice from the dispatcher."""

    channel = models.ForeignKey(NotificationChannel, on_delete=models.CASCADE, related_name="deliveries")
    alert = models.ForeignKey(Alert, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    event = models.CharField(max_length=20, choices=NotificationEvent.choices)
    payload = models.JSONField(default=dict)  # the alert as it was when the event was dispatched
    status = models.CharField(max_length=10, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(db_default=Now())
    # an attempt in progress: nobody else takes the delivery before this
    locked_until = models.DateTimeField(null=True, blank=True)
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now())
    delivered_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "alert_deliveries"
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["channel", "-created_at"], name="alert_deliveries_by_channel"),
            models.Index(
                fields=["next_attempt_at"], condition=Q(status=DeliveryStatus.PENDING), name="alert_deliveries_pending"
            ),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["alert", "event", "channel"], condition=Q(alert__isnull=False), name="alert_delivery_once"
            )
        ]

    def __str__(self):
        return f"{self.event} to {self.channel_id} ({self.status})"


class OperatorChannelSecret(ChannelCredentials):
    """The operators' webhook channels' credentials. They belong to no tenant, so they
    live in `public`, in a table of their own: the confidential app's tables exist in
    tenant schemas only, so that a read of them outside a tenant's schema fails instead
    of finding another table through the search path."""

    class Meta:
        db_table = "operator_channel_secrets"
