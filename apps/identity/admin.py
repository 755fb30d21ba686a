"""Operators' admin for identity: the mapping table (the API's PUT replaces it whole;
here rows are added, changed and deleted one by one) and the directory accounts seen."""

from django import forms
from django.contrib import admin

from apps.core.admin_tools import operator
from apps.core.audit import record_operator_audit
from apps.identity.models import DirectoryIdentity, GroupMapping


class GroupMappingForm(forms.ModelForm):
    class Meta:
        model = GroupMapping
        fields = ["group", "tenant", "role", "operator"]

    def clean(self):
        data = super().clean()
        if data.get("operator"):
            if data.get("tenant") or data.get("role"):
                raise forms.ValidationError("An operator mapping names no tenant and no role.")
        elif not data.get("tenant") or not data.get("role"):
            raise forms.ValidationError("A mapping names a tenant and a role, or is an operator mapping.")
        group = (data.get("group") or "").strip()
        clash = GroupMapping.objects.exclude(pk=self.instance.pk).filter(group__iexact=group)
        clash = clash.filter(operator=True) if data.get("operator") else clash.filter(tenant=data.get("tenant"))
        if group and clash.exists():
            raise forms.ValidationError(f"Group '{group}' is mapped there already.")
        data["group"] = group
        return data


@admin.register(GroupMapping)
class GroupMappingAdmin(admin.ModelAdmin):
    form = GroupMappingForm
    list_display = ["group", "tenant", "role", "operator", "created_at"]
    list_filter = ["operator", "tenant"]
    search_fields = ["group", "tenant__name"]

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        action = "identity.mapping_changed" if change else "identity.mapping_added"
        record_operator_audit(operator(request), action, str(obj))

    def delete_model(self, request, obj):
        record_operator_audit(operator(request), "identity.mapping_deleted", str(obj))
        super().delete_model(request, obj)

    def delete_queryset(self, request, queryset):
        for mapping in queryset:
            record_operator_audit(operator(request), "identity.mapping_deleted", str(mapping))
        super().delete_queryset(request, queryset)


@admin.register(DirectoryIdentity)
class DirectoryIdentityAdmin(admin.ModelAdmin):
    list_display = ["user", "source", "subject", "last_sign_in_at"]
    list_filter = ["source"]
    search_fields = ["user__username", "subject"]
    readonly_fields = ["user", "source", "subject", "groups", "created_at", "last_sign_in_at"]

    def has_add_permission(self, request):
        return False
