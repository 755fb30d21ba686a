from django.conf import settings
from django.db import models
from django.db.models import Q

from apps.core.models import TenantOwned


class GpuAllocation(TenantOwned):
    """The GPU ledger: which task holds which card. A whole-card holder (memory_mb null)
    is alone on its card, enforced by the database as well as by bind's re-check."""

    task = models.ForeignKey("tasks.Task", on_delete=models.CASCADE, related_name="allocations")
    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="allocations")
    gpu_index = models.PositiveIntegerField()
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    memory_mb = models.PositiveBigIntegerField(null=True, blank=True, help_text="null: the whole card")
    created_at = models.DateTimeField(auto_now_add=True)
    # the card's energy accumulator (gpus.energy_wh) when the task took it: the task's
    # energy is the accumulator's growth while it holds the card (apps.nodes.energy)
    energy_wh_at_bind = models.FloatField(null=True, blank=True)

    class Meta:
        db_table = "gpu_allocations"
        constraints = [
            models.UniqueConstraint(
                fields=["node", "gpu_index"], condition=Q(memory_mb__isnull=True), name="allocation_whole_card_once"
            ),
            models.UniqueConstraint(fields=["task", "node", "gpu_index"], name="allocation_task_card_once"),
        ]
        indexes = [models.Index(fields=["node", "gpu_index"], name="allocation_node_card")]


class PluginConfig(models.Model):
    """Persisted plugin settings; the scheduler reads them at the start of every cycle."""

    name = models.CharField(max_length=40, primary_key=True)
    enabled = models.BooleanField(default=True)
    weight = models.FloatField(default=1.0)
    extra = models.JSONField(default=dict, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "scheduler_plugins"


class QueueCursor(models.Model):
    """Where the last bounded batch ended, so the tail of a long queue is not starved.
    Row 1: the single tasks' batch (`task_id` the last task's id); row 2: the task
    groups' window (`task_id` the last group's id; services.GROUP_CURSOR_ROW)."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    priority = models.IntegerField(null=True)
    created_at = models.DateTimeField(null=True)
    task_id = models.BigIntegerField(null=True)

    class Meta:
        db_table = "scheduler_queue_cursor"


class Simulation(models.Model):
    """A replay an operator asked for (docs/simulate.md#from-the-api-hf-and-the-portal):
    what to replay (`request`, as POST /api/v1/admin/simulations took it), how far it got,
    and its report and charts once done. Written by apps.scheduler.simulations only."""

    class State(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    progress = models.FloatField(default=0.0, help_text="0–1: the share of the runs' simulated arrivals")
    request = models.JSONField(help_text="work, fleet and policies, as the API took them")
    report = models.JSONField(null=True, blank=True, help_text="report.json (docs/simulate.md#output)")
    charts = models.JSONField(default=dict, blank=True, help_text="chart name -> PNG, base64")
    error = models.TextField(blank=True, default="")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    moved_at = models.DateTimeField(null=True, blank=True, help_text="its last progress")
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "scheduler_simulations"
        ordering = ["-created_at", "-id"]
