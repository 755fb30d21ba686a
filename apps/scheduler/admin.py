"""Operators' admin for the scheduler's plugins: one page listing the effective
configuration (apps.scheduler.plugins.plugin_table, what the scheduler itself reads),
with enable/disable, weight and options changed through the services the API uses (so
the layout plugins stay mutually exclusive and the locked ones stay on)."""

import json

from django import forms
from django.contrib import admin, messages
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from rest_framework.exceptions import APIException, ValidationError

from apps.core.admin_tools import operator, refusal
from apps.scheduler import plugins, quotas
from apps.scheduler.api.views import PluginOptionsSerializer
from apps.scheduler.models import PluginConfig
from apps.tenants.models import Cohort, QueueQuota, TenantQueue


@admin.register(PluginConfig)
class PluginConfigAdmin(admin.ModelAdmin):
    change_list_template = "admin/scheduler/pluginconfig/change_list.html"

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return redirect("admin:scheduler_pluginconfig_changelist")

    def changelist_view(self, request, extra_context=None):
        if request.method == "POST":
            if not self.has_change_permission(request):
                from django.core.exceptions import PermissionDenied

                raise PermissionDenied
            self.apply(request)
            return redirect("admin:scheduler_pluginconfig_changelist")
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "title": "Scheduler plugins",
            "plugins": [
                row | {"extra_json": json.dumps(row["extra"], sort_keys=True)} for row in plugins.plugin_table()
            ],
            "has_change_permission": self.has_change_permission(request),
        }
        return TemplateResponse(request, self.change_list_template, context)

    def apply(self, request) -> None:
        name, action = request.POST.get("plugin", ""), request.POST.get("action", "")
        if name not in plugins.PLUGINS:
            self.message_user(request, f"No scheduler plugin '{name}'.", messages.ERROR)
            return
        try:
            if action in ("enable", "disable"):
                plugins.set_plugin_enabled(name, action == "enable")
                spec = plugins.PLUGINS[name]
                also = (
                    f"; {spec.exclusive_with} is {'disabled' if action == 'enable' else 'enabled'}"
                    if spec.exclusive_with
                    else ""
                )
                self.message_user(request, f"{name} {action}d{also}.", messages.SUCCESS)
            elif action == "options":
                data = {"weight": request.POST["weight"]} if request.POST.get("weight", "").strip() else {}
                if request.POST.get("extra", "").strip():
                    try:
                        data["extra"] = json.loads(request.POST["extra"])
                    except ValueError:
                        raise ValidationError({"extra": ["Not valid JSON."]}) from None
                serializer = PluginOptionsSerializer(data=data)
                serializer.is_valid(raise_exception=True)
                plugins.set_plugin_options(name, **serializer.validated_data)
                self.message_user(request, f"{name} saved.", messages.SUCCESS)
            else:
                self.message_user(request, f"Unknown action '{action}'.", messages.ERROR)
        except APIException as exc:
            self.message_user(request, f"{name}: {refusal(exc)}", messages.ERROR)


# --- queues (docs/queues.md): written through apps.scheduler.quotas, like the API -------


class QueueQuotaInline(admin.TabularInline):
    model = QueueQuota
    extra = 1
    fields = ["gpu_type", "nominal", "borrowing_limit", "lending_limit"]


class TenantQueueForm(forms.ModelForm):
    cohort_name = forms.SlugField(
        required=False,
        max_length=40,
        label="Cohort",
        help_text="Tenants of one cohort lend each other their idle nominal cards. Empty: none (no lending, "
        "no borrowing). A new name makes a new cohort.",
    )

    class Meta:
        model = TenantQueue
        fields = ["tenant", "weight"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk and self.instance.cohort_id:
            self.fields["cohort_name"].initial = self.instance.cohort.name

    def clean_weight(self):
        weight = self.cleaned_data["weight"]
        if not 0 < weight <= 1000:
            raise forms.ValidationError("A weight above 0, at most 1000.")
        return weight


@admin.register(TenantQueue)
class TenantQueueAdmin(admin.ModelAdmin):
    form = TenantQueueForm
    inlines = [QueueQuotaInline]
    list_display = ["tenant", "cohort", "weight", "nominal"]
    list_select_related = ["tenant", "cohort"]

    def get_readonly_fields(self, request, obj=None):
        return ["tenant"] if obj else []

    @admin.display(description="nominal cards")
    def nominal(self, obj):
        return ", ".join(f"{quota.gpu_type} {quota.nominal}" for quota in obj.quotas.all()) or "none"

    def save_model(self, request, obj, form, change):
        """Written with its quotas by save_related, in one call of the service."""

    def save_related(self, request, form, formsets, change):
        rows = [
            row.cleaned_data
            for formset in formsets
            for row in formset.forms
            if row.cleaned_data and not row.cleaned_data.get("DELETE")
        ]
        warnings = quotas.set_queue(
            form.instance.tenant,
            cohort=form.cleaned_data.get("cohort_name") or None,
            weight=form.cleaned_data["weight"],
            quotas=[
                quotas.QuotaInput(row["gpu_type"], row["nominal"], row.get("borrowing_limit"), row.get("lending_limit"))
                for row in rows
            ],
            principal=operator(request),
        )
        for warning in warnings:
            messages.warning(request, warning)
        for formset in formsets:  # what the change message reads (saved by the service, not the formset)
            formset.new_objects, formset.changed_objects, formset.deleted_objects = [], [], []

    def delete_model(self, request, obj):
        quotas.remove_queue(obj.tenant, principal=operator(request))


@admin.register(Cohort)
class CohortAdmin(admin.ModelAdmin):
    list_display = ["name", "members", "created_at"]
    fields = ["name", "description"]

    @admin.display(description="tenants")
    def members(self, obj):
        return ", ".join(queue.tenant.slug for queue in obj.queues.select_related("tenant")) or "none"
