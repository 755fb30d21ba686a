"""Operators' admin for the scheduler's plugins: one page listing the effective
configuration (apps.scheduler.plugins.plugin_table, what the scheduler itself reads),
with enable/disable, weight and options changed through the services the API uses (so
the layout plugins stay mutually exclusive and the locked ones stay on)."""

import json

from django.contrib import admin, messages
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from rest_framework.exceptions import APIException, ValidationError

from apps.core.admin_tools import refusal
from apps.scheduler import plugins
from apps.scheduler.api.views import PluginOptionsSerializer
from apps.scheduler.models import PluginConfig


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
