"""Operators' admin for tasks: read, filter, and act through apps.tasks.services (cancel
or stop as POST /api/v1/tasks/{id}/stop does; requeue). Tasks are created through the
API or the portal, where their validation lives. Task groups likewise: read, filter,
their members inline, stopped as POST /api/v1/task-groups/{id}/stop does."""

from django.contrib import admin, messages

from apps.core.errors import Conflict
from apps.tasks import services
from apps.tasks.choices import GroupStatus
from apps.tasks.models import Task, TaskEvent, TaskGroup
from apps.tasks.selectors import with_group_status


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


# --- task groups -----------------------------------------------------------------------------


class TaskGroupMemberInline(admin.TabularInline):
    """The workers, in rank order, read only (they move through the services)."""

    model = Task
    fk_name = "group"
    extra = 0
    can_delete = False
    ordering = ["rank"]
    show_change_link = True
    fields = readonly_fields = ["rank", "name", "status", "node", "host_port", "exit_code", "started_at", "finished_at"]

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class GroupStatusFilter(admin.SimpleListFilter):
    """The status derived from the members, filtered in SQL (selectors.with_group_status)."""

    title = "status"
    parameter_name = "status"

    def lookups(self, request, model_admin):
        return GroupStatus.choices

    def queryset(self, request, queryset):
        if self.value() in GroupStatus.values:
            return with_group_status(queryset).filter(derived_status=self.value())
        return queryset


@admin.register(TaskGroup)
class TaskGroupAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "name",
        "tenant",
        "kind",
        "strategy",
        "world_size",
        "gpus_per_worker",
        "gpu_type",
        "status",
        "attempts",
        "created_at",
    ]
    list_filter = [
        GroupStatusFilter,
        "kind",
        "strategy",
        "gpu_type",
        ("tenant", admin.RelatedOnlyFieldListFilter),
    ]
    search_fields = ["=id", "name", "image"]
    list_select_related = ["tenant"]
    date_hierarchy = "created_at"
    inlines = [TaskGroupMemberInline]
    actions = ["stop"]
    readonly_fields = [field.name for field in TaskGroup._meta.fields] + ["status"]

    def get_queryset(self, request):
        return super().get_queryset(request).with_status()

    @admin.display(description="status")
    def status(self, group):
        return group.status

    def has_add_permission(self, request):
        return False  # submitted through the API or the portal, where the validation lives

    def has_delete_permission(self, request, obj=None):
        return False  # its members' history stays; stop it instead

    def has_change_permission(self, request, obj=None):
        return False

    @admin.action(description="Stop (every member)")
    def stop(self, request, queryset):
        for group in queryset:
            try:
                group = services.stop_group(group)
            except Conflict as exc:
                self.message_user(request, str(exc.detail), messages.ERROR)
            else:
                self.message_user(request, f"Task group #{group.pk} is {group.status}.", messages.SUCCESS)
