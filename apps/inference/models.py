from __future__ import annotations

from django.db import models

from apps.core.models import TenantOwned
from apps.core.scoping import ScopedQuerySet
from apps.inference.choices import ModelFormat, ServiceStatus, SourceKind


class ModelQuerySet(ScopedQuerySet):
    tenant_field = "tenant"


class Model(TenantOwned):
    """A model a tenant registered: what clients name in `"model"`, where its weights come
    from, their format and size, the engines that can serve it, and optionally the nodes it
    is registered on (node pinning). Where it is cached is not stored: it is joined from
    the nodes' reports (apps.inference.selectors.cached_on)."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="inference_models")
    name = models.CharField(max_length=200, help_text='What clients put in "model"; unique per tenant.')
    source_kind = models.CharField(max_length=10, choices=SourceKind.choices)
    source = models.CharField(max_length=1024, help_text="The path, the image reference or the hub id.")
    format = models.CharField(max_length=20, choices=ModelFormat.choices)
    size_bytes = models.BigIntegerField(null=True, blank=True, help_text="Empty: not known.")
    engines = models.JSONField(
        default=list, blank=True, help_text="Engines that can serve it; empty: the engine router chooses by format."
    )
    nodes = models.ManyToManyField(
        "nodes.Node",
        blank=True,
        related_name="registered_models",
        help_text="The nodes it is registered on; empty: not pinned. A node with registrations is not deleted "
        "without force.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ModelQuerySet.as_manager()

    class Meta:
        db_table = "inference_models"
        ordering = ["name", "id"]
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="inference_model_tenant_name_unique")]
        indexes = [models.Index(fields=["tenant", "format"], name="inference_models_tenant_format")]

    def __str__(self):
        return self.name


class ServiceQuerySet(ScopedQuerySet):
    tenant_field = "group__tenant"


class InferenceService(models.Model):
    """A model served behind the gateway: a task group of kind `inference` placed as
    `replicas` (each replica a task of the group, rank = replica slot, with a host port),
    plus what keeps it serving: the replica bounds, the engine, the autoscaling, window and
    sleep policies (each parsed by its pure module), and the state those modules read and
    write. The group carries tenant, name, gpu_type, GPUs per replica (`gpus_per_worker`;
    1 for a memory-share service, whose replicas ask 0 whole cards: `memory_share`),
    image, env, priority and labels; `group.world_size` is not the replica count:
    `replicas` is."""

    group = models.OneToOneField("tasks.TaskGroup", on_delete=models.CASCADE, primary_key=True, related_name="service")
    model = models.ForeignKey(
        Model,
        on_delete=models.RESTRICT,
        related_name="services",
        help_text="a model in use is not deleted alone (its tenant's deletion takes both)",
    )
    engine = models.CharField(max_length=20, default="auto", help_text='an engine name, or "auto": the agent\'s router')
    gpu_memory_mb = models.PositiveBigIntegerField(null=True, blank=True, help_text="GPU memory per replica")
    # gpus_per_replica 0: each replica is a memory-only task (gpu_required 0, gpu_memory_mb)
    # on a share of one card, placed and sliced as such a task is. Stored here, not as the
    # group's gpus_per_worker 0: a group's sizes are positive (task_group_sizes_positive),
    # and its 1 is true of the replicas, each on one card.
    memory_share = models.BooleanField(
        default=False, help_text="replicas share cards by gpu_memory_mb (gpus_per_replica 0)"
    )
    memory_request_mb = models.PositiveBigIntegerField(null=True, blank=True, help_text="host memory per replica")
    engine_args = models.JSONField(default=list, blank=True, help_text="extra engine arguments (argv list)")
    health_probe = models.JSONField(null=True, blank=True, help_text="as for tasks; default: GET /v1/models")
    min_replicas = models.PositiveIntegerField(default=1)
    max_replicas = models.PositiveIntegerField(default=1)
    replicas = models.PositiveIntegerField(default=1, help_text="the count the service asks for now")
    autoscaling = models.JSONField(default=dict, blank=True, help_text="autoscale.parse_policy's input")
    window = models.JSONField(null=True, blank=True, help_text="windows.parse_window's input; empty: always")
    sleep_after_seconds = models.PositiveIntegerField(null=True, blank=True, help_text="empty: never sleeps")
    state = models.CharField(max_length=10, choices=ServiceStatus.choices, default=ServiceStatus.STARTING)
    state_changed_at = models.DateTimeField(auto_now_add=True)
    # the AutoScaler's memory (autoscale.ScalingState): the last change and its direction
    last_scaled_at = models.DateTimeField(null=True, blank=True)
    last_scale_direction = models.CharField(max_length=4, blank=True, default="")
    # the window's memory (windows.WindowState): the action it applied and still holds, and
    # the count from before it (pause and scale restore it; stop does not)
    window_action = models.CharField(max_length=10, blank=True, default="")
    window_remembered = models.PositiveIntegerField(null=True, blank=True)
    last_request_at = models.DateTimeField(null=True, blank=True, help_text="the gateway's last request for it")
    lendable = models.BooleanField(
        default=True,
        help_text="idle replicas' cards may be lent to its tenant's (or tenant group's) training; false: never",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ServiceQuerySet.as_manager()

    class Meta:
        db_table = "inference_services"
        ordering = ["group_id"]
        indexes = [models.Index(fields=["state"], name="inference_services_state")]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(min_replicas__lte=models.F("max_replicas")), name="inference_service_min_le_max"
            ),
            models.CheckConstraint(
                condition=models.Q(replicas__lte=models.F("max_replicas")), name="inference_service_replicas_le_max"
            ),
            models.CheckConstraint(
                condition=models.Q(memory_share=False) | models.Q(gpu_memory_mb__gte=1),
                name="inference_service_share_has_memory",
            ),
        ]

    def __str__(self):
        return f"{self.group.name} ({self.model.name}, {self.replicas} replicas, {self.state})"


class ServiceDecision(models.Model):
    """One decision about a service, with its reason: the AutoScaler's scale (or hold with
    a reason worth showing), a window's move, sleep and wake, a rebuild, a user's scale or
    stop, a loan of its cards to a training task and their return (source `lending`,
    actions `borrowed` and `returned`). What the portal shows as the service's history."""

    service = models.ForeignKey(InferenceService, on_delete=models.CASCADE, related_name="decisions")
    source = models.CharField(max_length=12, help_text="autoscaler | window | sleep | wake | rebuild | user | lending")
    action = models.CharField(max_length=20, help_text="scale_up, scale_down, pause, sleep, recreate, …")
    from_replicas = models.PositiveIntegerField(null=True, blank=True)
    to_replicas = models.PositiveIntegerField(null=True, blank=True)
    reason = models.TextField(max_length=2000)
    details = models.JSONField(default=dict, blank=True, help_text="the signals and figures behind it")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "inference_service_decisions"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["service", "-created_at"], name="inference_decisions_service")]


class LoanState(models.TextChoices):
    OPEN = "open", "lent: the training holds (or waits for) the cards"
    RETURNED = "returned", "given back: the service scaled up or woken again"


class ServiceLoan(models.Model):
    """Idle replicas of a service lent to a training task (spec 004, "训练借卡"): the cycle
    lends (apps.inference.lending.lend: the service scaled down to `to_replicas`, or put
    to sleep), the 15 s patrol gives back (the training ended or never got the cards,
    or the service has traffic again: then the training is preempted). One open loan a
    service."""

    service = models.ForeignKey(InferenceService, on_delete=models.CASCADE, related_name="loans")
    borrower = models.ForeignKey(
        "tasks.Task", on_delete=models.CASCADE, related_name="loans", help_text="the training (a group's: rank 0)"
    )
    borrower_group = models.ForeignKey(
        "tasks.TaskGroup",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="loans",
        help_text="a training task group's loan: every member holds the cards",
    )
    node_id = models.CharField(max_length=255, help_text="where the borrower was planned")
    sleeps = models.BooleanField(default=False, help_text="every replica lent: the service was put to sleep")
    from_replicas = models.PositiveIntegerField(help_text="the count before the loan (given back)")
    to_replicas = models.PositiveIntegerField(help_text="the count while it is lent")
    replicas = models.JSONField(default=list, help_text="the replica tasks that stopped for it")
    state = models.CharField(max_length=10, choices=LoanState.choices, default=LoanState.OPEN)
    bound_at = models.DateTimeField(null=True, blank=True, help_text="when the patrol first saw the borrower placed")
    returned_at = models.DateTimeField(null=True, blank=True)
    returned_why = models.CharField(max_length=500, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "inference_service_loans"
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["service"], condition=models.Q(state="open"), name="inference_loan_one_open_per_service"
            )
        ]
        indexes = [
            models.Index(fields=["state"], name="inference_loans_state", condition=models.Q(state="open")),
            models.Index(fields=["borrower"], name="inference_loans_borrower"),
        ]

    def __str__(self):
        return (
            f"{self.service_id} lent {self.from_replicas - self.to_replicas} to task {self.borrower_id} ({self.state})"
        )
