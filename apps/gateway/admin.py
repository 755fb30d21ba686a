"""Operators' admin for endpoint keys, tenant limits and usage. Keys are created and
rotated through the API or the portal (the secret is shown once there); here they are
read, limited and revoked."""

from django import forms
from django.contrib import admin
from django.db import transaction

from apps.gateway import catalog, services
from apps.gateway.models import EndpointKey, ExternalBackend, ServiceRoute, TenantLimits, UsageBucket


class AnnouncingAdmin(admin.ModelAdmin):
    """A change made here reaches the gateway processes as a service's does."""

    def save_model(self, request, obj, form, change):
        with transaction.atomic():
            super().save_model(request, obj, form, change)
            catalog.changed()

    def delete_model(self, request, obj):
        with transaction.atomic():
            super().delete_model(request, obj)
            catalog.changed()


class EndpointKeyForm(forms.ModelForm):
    """A key's limits bounded here as through the API (services.key_limit_problems): only
    the limits changed are checked, so a key above a bound lowered since stays editable."""

    class Meta:
        model = EndpointKey
        fields = "__all__"

    def clean(self):
        cleaned = super().clean()
        changed = {name: cleaned.get(name) for name in services.LIMIT_FIELDS if name in self.changed_data}
        for name, problems in services.key_limit_problems(self.instance.tenant, changed).items():
            self.add_error(name, problems)
        return cleaned


@admin.register(EndpointKey)
class EndpointKeyAdmin(AnnouncingAdmin):
    form = EndpointKeyForm
    list_display = [
        "name",
        "display_prefix",
        "tenant",
        "rpm_limit",
        "tpm_limit",
        "concurrency_limit",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]
    list_filter = ["tenant"]
    search_fields = ["name", "display_prefix"]
    readonly_fields = [
        "tenant",
        "key_hash",
        "display_prefix",
        "previous_key_hash",
        "previous_display_prefix",
        "previous_valid_until",
        "created_by",
        "created_at",
        "rotated_at",
        "last_used_at",
    ]

    def has_add_permission(self, request):
        return False  # the secret is shown once: create keys through the API or the portal


@admin.register(TenantLimits)
class TenantLimitsAdmin(AnnouncingAdmin):
    list_display = ["tenant", "rpm_limit", "tpm_limit", "concurrency_limit", "updated_at"]


@admin.register(ServiceRoute)
class ServiceRouteAdmin(AnnouncingAdmin):
    list_display = ["service", "priority", "weight", "updated_at"]
    raw_id_fields = ["service"]


@admin.register(ExternalBackend)
class ExternalBackendAdmin(admin.ModelAdmin):
    """Read and disable here; declared and re-pointed through the API, where the URL is checked."""

    list_display = ["model", "tenant", "base_url", "priority", "weight", "enabled", "updated_at"]
    list_filter = ["tenant", "enabled"]
    readonly_fields = ["tenant", "model", "base_url", "secret_name", "created_by", "created_at", "updated_at"]

    def has_add_permission(self, request):
        return False

    def save_model(self, request, obj, form, change):
        with transaction.atomic():
            super().save_model(request, obj, form, change)
            catalog.changed()


@admin.register(UsageBucket)
class UsageBucketAdmin(admin.ModelAdmin):
    list_display = [
        "minute",
        "tenant",
        "key",
        "model",
        "service_id",
        "requests",
        "errors",
        "prompt_tokens",
        "completion_tokens",
    ]
    list_filter = ["tenant", "model"]
    readonly_fields = [f.name for f in UsageBucket._meta.fields]
