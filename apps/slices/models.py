from __future__ import annotations

from django.db import models
from django.db.models import Q

from apps.core.models import TenantOwned
from apps.core.scoping import ScopedQuerySet
from apps.slices.choices import HOLDING, LIVE, QOS_OF_TIER, RequestStatus, SliceAction, SliceState, SliceVendor, Tier


class SliceQuerySet(ScopedQuerySet):
    tenant_field = "tenant"


class Slice(TenantOwned):
    """A share of one card carved for one memory-only task (only `gpu_memory_mb`): its
    tier (derived from the card at bind, `reason` says why), its limits, and its own
    state, so that a crash between the task's move and the slice's leaves a row the
    compensation scan can finish. An orphan found on a card (a MIG instance no slice
    owns) gets a row of its own with no task, to be destroyed."""

    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="slices")
    gpu_index = models.PositiveIntegerField()
    gpu_uuid = models.CharField(max_length=128, blank=True, default="")
    tenant = models.ForeignKey(
        "tenants.Tenant",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="slices",
        help_text="Empty only for an orphan found on a card.",
    )
    task = models.ForeignKey(
        "tasks.Task",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="slices",
        help_text="The task it serves; empty for an orphan found on a card (or once the task is deleted).",
    )
    tier = models.CharField(max_length=10, choices=Tier.choices)
    memory_mb = models.PositiveBigIntegerField(help_text="The memory limit (for MIG: the profile's memory).")
    compute_percent = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="The compute share (MPS active thread percentage; MIG: the profile's)."
    )
    profile = models.CharField(max_length=32, blank=True, default="", help_text="The MIG profile, e.g. 1g.18gb.")
    state = models.CharField(max_length=10, choices=SliceState.choices, default=SliceState.REQUESTED)
    device_id = models.CharField(
        max_length=128, blank=True, default="", help_text="Once confirmed: the MIG device's UUID, the card's for MPS."
    )
    # the vendor's handles once made (MIG: {"gi": 1, "ci": 0}; HAMi: the cgroup path…)
    handles = models.JSONField(default=dict, blank=True)
    # why this tier: {"tier": "mig", "why": "card 0 reports MIG mode Enabled"}
    reason = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    confirmed_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)

    objects = SliceQuerySet.as_manager()

    class Meta:
        db_table = "slices"
        ordering = ["node_id", "gpu_index", "id"]
        constraints = [
            # one slice serving a task at a time (a requeued task's old one may still be
            # releasing while the next bind carves a new one)
            models.UniqueConstraint(fields=["task"], condition=Q(state__in=HOLDING), name="slice_holding_per_task"),
        ]
        indexes = [
            models.Index(fields=["node", "gpu_index"], name="slices_node_card"),
            models.Index(fields=["state"], name="slices_live", condition=Q(state__in=LIVE)),
            models.Index(fields=["tenant", "state"], name="slices_tenant_state"),
        ]

    def __str__(self):
        return f"slice {self.pk} {self.tier} {self.memory_mb} MB on {self.node_id}/{self.gpu_index}"

    @property
    def qos(self) -> str:
        return QOS_OF_TIER[self.tier]


class SliceRequest(models.Model):
    """An intent for the agent (create or destroy one slice on its node), claimed by CAS
    pending → processing and reported completed / failed like a task. A destroy request
    of an orphan carries the orphan's slice row. `result` is the agent's truthful report,
    partial outcomes included: {"created": [{"uuid", "gi", "ci", "profile"}...],
    "destroyed": [...], "error": "..."}."""

    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="slice_requests")
    slice = models.ForeignKey(Slice, on_delete=models.CASCADE, related_name="requests")
    action = models.CharField(max_length=10, choices=SliceAction.choices)
    vendor = models.CharField(max_length=16, choices=SliceVendor.choices)
    # what the agent needs and re-validates: {"gpu_index", "gpu_uuid", "profile",
    # "memory_mb", "compute_percent", "device_id", "handles"}
    params = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=12, choices=RequestStatus.choices, default=RequestStatus.PENDING)
    result = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True, help_text="claimed_at + 2 minutes")
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "slice_requests"
        ordering = ["id"]
        constraints = [
            # one open request per slice: an intent is not issued twice
            models.UniqueConstraint(
                fields=["slice"], condition=Q(status__in=("pending", "processing")), name="slice_request_open_once"
            ),
        ]
        indexes = [
            models.Index(fields=["node", "status", "id"], name="slice_requests_poll"),
        ]

    def __str__(self):
        return f"{self.action} slice {self.slice_id} on {self.node_id} ({self.status})"
