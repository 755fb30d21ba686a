"""Operators' admin for alerts (resolve, acknowledge) and notification channels: a view of
channels and their deliveries, and actions that go through the services like the API. Channels are created through the
API or the portal, whose answer shows a webhook's secret once; the admin never shows a
webhook's URL or secret (they live in the tenant's schema)."""

from django.contrib import admin, messages

from apps.alerts import services as alert_services
from apps.alerts.models import Alert, NotificationChannel, NotificationDelivery
from apps.alerts.notifications import channels as services
from apps.core.errors import Conflict
from apps.core.principals import Principal, PrincipalKind


def operator(request) -> Principal:
    return Principal(PrincipalKind.OPERATOR, user=request.user)


@admin.register(Alert)
class AlertAdmin(admin.ModelAdmin):
    list_display = [
        "created_at",
        "type",
        "severity",
        "scope",
        "state",
        "node_id",
        "task",
        "tenant",
        "acknowledged_at",
        "ended_at",
    ]
    list_filter = ["state", "type", "severity", "scope", "tenant"]
    search_fields = ["key", "node_id", "message"]
    date_hierarchy = "created_at"
    list_select_related = ["tenant", "task"]
    readonly_fields = [field.name for field in Alert._meta.fields]
    actions = ["resolve", "acknowledge"]

    def has_add_permission(self, request):
        return False  # alerts are raised by the control plane, never by hand

    def has_change_permission(self, request, obj=None):
        return False  # resolve and acknowledge are the only changes (the actions below)

    def has_delete_permission(self, request, obj=None):
        return False  # the history stays

    @admin.action(description="Resolve selected alerts")
    def resolve(self, request, queryset):
        done = sum(alert_services.resolve_alert(alert, request.user) for alert in queryset)
        self.message_user(
            request, f"Resolved {done} alert(s); {queryset.count() - done} had already ended.", messages.SUCCESS
        )

    @admin.action(description="Acknowledge selected alerts")
    def acknowledge(self, request, queryset):
        done = sum(alert_services.acknowledge_alert(alert, request.user) for alert in queryset)
        self.message_user(request, f"Acknowledged {done} alert(s).", messages.SUCCESS)


@admin.register(NotificationChannel)
class NotificationChannelAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "tenant",
        "kind",
        "enabled",
        "min_severity",
        "consecutive_failures",
        "last_success_at",
        "last_failure_at",
    ]
    list_filter = ["kind", "enabled", "tenant"]
    search_fields = ["name", "tenant__slug"]
    fields = [
        "tenant",
        "name",
        "kind",
        "recipients",
        "min_severity",
        "types",
        "enabled",
        "created_at",
        "created_by",
        "updated_at",
        "last_success_at",
        "last_failure_at",
        "last_error",
        "consecutive_failures",
    ]
    readonly_fields = fields
    actions = ["send_test", "enable", "disable"]

    def has_add_permission(self, request):
        return False  # a webhook's secret is shown once: create channels through the API

    def has_change_permission(self, request, obj=None):
        return False  # changes go through the API (the actions below are the exceptions)

    def delete_model(self, request, obj):
        services.delete_channel(obj, principal=operator(request))

    def delete_queryset(self, request, queryset):
        for channel in queryset.select_related("tenant"):
            services.delete_channel(channel, principal=operator(request))

    @admin.action(description="Send a test notification")
    def send_test(self, request, queryset):
        for channel in queryset.select_related("tenant"):
            try:
                services.send_test(channel, principal=operator(request))
            except Conflict as exc:
                self.message_user(request, f"{channel.name}: {exc.detail}", messages.WARNING)
            else:
                self.message_user(request, f"{channel.name}: test queued.", messages.SUCCESS)

    @admin.action(description="Enable selected channels")
    def enable(self, request, queryset):
        self._set_enabled(request, queryset, True)

    @admin.action(description="Disable selected channels")
    def disable(self, request, queryset):
        self._set_enabled(request, queryset, False)

    def _set_enabled(self, request, queryset, enabled: bool):
        changed = 0
        for channel in queryset.select_related("tenant"):
            if channel.enabled != enabled:
                services.update_channel(channel, principal=operator(request), enabled=enabled)
                changed += 1
        self.message_user(request, f"{'Enabled' if enabled else 'Disabled'} {changed} channel(s).", messages.SUCCESS)


@admin.register(NotificationDelivery)
class NotificationDeliveryAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "channel",
        "event",
        "alert_id",
        "status",
        "attempts",
        "last_status_code",
        "last_error",
        "created_at",
        "delivered_at",
        "failed_at",
    ]
    list_filter = ["status", "event"]
    search_fields = ["channel__name"]
    list_select_related = ["channel__tenant"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    # deletable (as Django's permissions say): deleting a channel deletes its deliveries
