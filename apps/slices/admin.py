"""Operators' admin for slices and their requests: read, filter, search. Slices are made
at bind and given back through move_tasks; their requests move by the agent's CAS and
the compensation scan (apps.slices.services), so nothing here adds, changes or deletes
them: an edit in the admin would bypass the state machine (docs/slices.md)."""

from django.contrib import admin

from apps.slices.models import Slice, SliceRequest


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class SliceRequestInline(admin.TabularInline):
    model = SliceRequest
    extra = 0
    can_delete = False
    fields = readonly_fields = ["id", "action", "vendor", "status", "error", "created_at", "claimed_at", "finished_at"]
    ordering = ["-id"]

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Slice)
class SliceAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "node",
        "gpu_index",
        "tier",
        "profile",
        "memory_mb",
        "state",
        "device_id",
        "tenant",
        "task",
        "created_at",
    ]
    list_filter = ["state", "tier", "tenant"]
    search_fields = ["node__id", "node__name", "device_id", "gpu_uuid", "task__name"]
    list_select_related = ["node", "tenant", "task"]
    readonly_fields = [f.name for f in Slice._meta.fields]
    inlines = [SliceRequestInline]


@admin.register(SliceRequest)
class SliceRequestAdmin(ReadOnlyAdmin):
    list_display = ["id", "node", "slice", "action", "vendor", "status", "created_at", "deadline", "finished_at"]
    list_filter = ["status", "action", "vendor"]
    search_fields = ["node__id", "slice__id", "error"]
    list_select_related = ["node", "slice"]
    readonly_fields = [f.name for f in SliceRequest._meta.fields]
