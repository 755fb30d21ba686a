from django.contrib import admin

from apps.tunnel.models import TunnelHostKey, TunnelSession


@admin.register(TunnelHostKey)
class TunnelHostKeyAdmin(admin.ModelAdmin):
    """Deleting a row forgets the node's pinned key: its next registration pins a new one
    (a reinstalled node)."""

    list_display = ("node", "fingerprint", "pinned_at", "last_connected_at", "last_instance")
    search_fields = ("node__id", "fingerprint")
    readonly_fields = ("node", "public_key", "fingerprint", "pinned_at", "last_connected_at", "last_instance")

    def has_add_permission(self, request):
        return False


@admin.register(TunnelSession)
class TunnelSessionAdmin(admin.ModelAdmin):
    """The audit of every way into a task: read-only."""

    list_display = ("started_at", "principal", "task_id", "node_id", "kind", "port", "outcome", "bytes_in", "bytes_out")
    list_filter = ("kind", "outcome")
    search_fields = ("principal", "node_id", "=task_id")
    date_hierarchy = "started_at"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
