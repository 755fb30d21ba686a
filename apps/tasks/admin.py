"""Operators' admin for tasks: read, filter, and act through apps.tasks.services (cancel
or stop as POST /api/v1/tasks/{id}/stop does; requeue). Tasks are created through the
API or the portal, where their validation lives."""

from django.contrib import admin, messages

from apps.core.errors import Conflict
from apps.tasks import services
from apps.tasks.models import Task, TaskEvent


class TaskEventInline(admin.TabularInline):
    model = TaskEvent
    extra = 0
    can_delete = False
    fields = readonly_fields = ["created_at", "kind", "message", "node"]

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Task)
class TaskAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "tenant", "kind", "status", "gpu_required", "node", "priority", "created_at"]
    list_filter = [
        "status",
        "kind",
        ("tenant", admin.RelatedOnlyFieldListFilter),
        ("node", admin.RelatedOnlyFieldListFilter),
    ]
    search_fields = ["=id", "name", "image"]
    list_select_related = ["tenant", "node"]
    date_hierarchy = "created_at"
    inlines = [TaskEventInline]
    actions = ["cancel", "requeue"]
    readonly_fields = [field.name for field in Task._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # a task's history stays; cancel it instead

    def has_change_permission(self, request, obj=None):
        return False  # read only: a task's status moves only through the services' compare-and-set

    @admin.action(description="Cancel or stop")
    def cancel(self, request, queryset):
        for task in queryset:
            try:
                task = services.stop_task(task)
            except Conflict as exc:
                self.message_user(request, str(exc.detail), messages.ERROR)
            else:
                self.message_user(request, f"Task #{task.pk} is {task.status}.", messages.SUCCESS)

    @admin.action(description="Requeue (stopped by the agent first if started)")
    def requeue(self, request, queryset):
        for task in queryset:
            try:
                task = services.requeue_task(task, why=f"requeued by {request.user.username}")
            except Conflict as exc:
                self.message_user(request, str(exc.detail), messages.ERROR)
            else:
                self.message_user(request, f"Task #{task.pk} is {task.status}.", messages.SUCCESS)
