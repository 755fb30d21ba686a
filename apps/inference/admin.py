"""Operators' admin for the model registry: read, filter, search, delete. Models are
registered and changed through the API or the portal, where their validation lives (the
known engines, the source's shape, nodes the tenant may use)."""

from django.contrib import admin

from apps.inference.models import Model


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "format", "source_kind", "source", "size_bytes", "created_at"]
    list_filter = ["format", "source_kind", "tenant"]
    search_fields = ["name", "source"]
    readonly_fields = [
        "tenant",
        "name",
        "source_kind",
        "source",
        "format",
        "size_bytes",
        "engines",
        "registered_nodes",
        "created_at",
        "updated_at",
    ]
    exclude = ["nodes"]

    @admin.display(description="nodes")
    def registered_nodes(self, obj):
        return ", ".join(sorted(node.pk for node in obj.nodes.all())) or "—"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
