"""Tasks. The foundation holds what tenancy needs (owner and state); the task issue adds
the workload fields, the transition table and the scheduler's columns."""

from django.conf import settings
from django.db import models

from apps.core.scoping import ScopedQuerySet
from apps.tasks.choices import TaskStatus


class TaskQuerySet(ScopedQuerySet):
    tenant_field = "tenant"


class Task(models.Model):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="tasks")
    name = models.CharField(max_length=200)
    status = models.CharField(max_length=20, choices=TaskStatus.choices, default=TaskStatus.PENDING)
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.PROTECT, related_name="tasks")
    gpu_required = models.PositiveIntegerField(default=1)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TaskQuerySet.as_manager()

    class Meta:
        db_table = "tasks"
        indexes = [
            models.Index(fields=["tenant", "status"], name="tasks_tenant_status"),
            models.Index(fields=["node", "status"], name="tasks_node_status"),
        ]

    def __str__(self):
        return f"{self.name} ({self.status})"
