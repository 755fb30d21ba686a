from __future__ import annotations

from datetime import datetime

from django.core.validators import MaxValueValidator
from django.db import models
from django.db.models import Exists, OuterRef, Q

from apps.core.models import TenantOwned
from apps.core.scoping import ScopedQuerySet
from apps.nodes import liveness
from apps.nodes.choices import (
    CardIdentity,
    CordonSource,
    ExecMode,
    ImageAction,
    ImageRequestStatus,
    LostBasis,
    NodeStatus,
    WatchedImageKind,
)
from apps.nodes.gpu_state import gpu_state


class NodeQuerySet(ScopedQuerySet):
    def visible_to(self, principal):
        """Shared nodes (no tenant) are visible to every tenant; dedicated nodes only to
        their own tenant."""
        if principal is not None and principal.is_tenant:
            return self.usable_by(principal.tenant.pk)
        return super().visible_to(principal)

    def usable_by(self, tenant_id):
        """The nodes a tenant may see and run on, whoever asks (an operator acting for the
        tenant): the shared ones and its own dedicated ones."""
        return self.filter(Q(tenant__isnull=True) | Q(tenant=tenant_id))


class Node(TenantOwned):
    """A GPU server with an agent. The id is the agent's own, persisted on its first start."""

    id = models.CharField(primary_key=True, max_length=128)
    name = models.CharField(max_length=200)
    tenant = models.ForeignKey(
        "tenants.Tenant",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="dedicated_nodes",
        help_text="Empty: a shared node. Set: dedicated to that tenant.",
    )
    status = models.CharField(max_length=10, choices=NodeStatus.choices, default=NodeStatus.ONLINE)
    # addresses
    ip = models.GenericIPAddressField(
        null=True, blank=True, help_text="Public address: the TCP source of the heartbeat."
    )
    internal_ip = models.GenericIPAddressField(null=True, blank=True)
    # the prefix length of internal_ip's interface, as the agent reads it: nodes whose
    # interfaces are in one subnet share a network domain (apps.nodes.network)
    internal_prefix = models.PositiveSmallIntegerField(
        null=True, blank=True, validators=[MaxValueValidator(128)], help_text="Prefix length of the internal address."
    )
    mac = models.CharField(max_length=17, blank=True, default="")
    # host facts
    hostname = models.CharField(max_length=255, blank=True, default="")
    os = models.CharField(max_length=200, blank=True, default="")
    cpu_cores = models.PositiveIntegerField(null=True, blank=True)
    memory_gb = models.FloatField(null=True, blank=True)
    is_container = models.BooleanField(default=False)
    # executability
    docker_available = models.BooleanField(default=False)
    executable = models.BooleanField(default=True)
    exec_mode = models.CharField(max_length=10, choices=ExecMode.choices, default=ExecMode.DOCKER)
    error_message = models.TextField(blank=True, default="")
    # the agent
    agent_version = models.CharField(max_length=64, blank=True, default="")
    agent_git_commit = models.CharField(max_length=64, blank=True, default="")
    agent_build_time = models.CharField(max_length=64, blank=True, default="")
    heartbeat_interval = models.PositiveIntegerField(default=5)
    # latest load (null: the agent did not read it)
    cpu_used = models.FloatField(null=True, blank=True)
    memory_used = models.FloatField(null=True, blank=True)
    gpu_temperature = models.FloatField(null=True, blank=True)
    gpu_memory_used_mb = models.BigIntegerField(null=True, blank=True)
    # GPUs, summarised for lists and filters
    gpu_type = models.CharField(max_length=20, blank=True, default="")  # indexed below
    gpu_model = models.CharField(max_length=200, blank=True, default="")
    gpu_count = models.PositiveIntegerField(default=0)
    gpu_collector_error = models.TextField(blank=True, default="")
    # self-description
    labels = models.JSONField(default=dict, blank=True)
    # the label keys the agent set and may remove (it sends `owned_label_keys`): a key in
    # here that a later beat leaves out is removed; every other key merges (docs/nodes.md)
    agent_label_keys = models.JSONField(default=list, blank=True)
    gpu_capabilities = models.JSONField(default=dict, blank=True)
    inference_engines = models.JSONField(default=list, blank=True)
    inference_engine_versions = models.JSONField(default=dict, blank=True)
    vllm_available = models.BooleanField(default=False)
    discovered_models = models.JSONField(default=list, blank=True)
    task_health = models.JSONField(default=list, blank=True)
    # the tasks the agent's runtime holds alive, from its latest beat; null: the agent did
    # not say (no executor, or its runtime could not be listed), which is not "none"
    live_task_ids = models.JSONField(null=True, blank=True, default=None)
    # location (operators)
    region = models.CharField(max_length=64, blank=True, default="")
    zone = models.CharField(max_length=64, blank=True, default="")
    rack = models.CharField(max_length=64, blank=True, default="")
    # CPU power, estimated (never measured): the agent's CPU model and sockets; the
    # operator's TDP for the node, else the model table's (apps.nodes.energy)
    cpu_model = models.CharField(max_length=200, blank=True, default="", db_default="")
    cpu_sockets = models.PositiveSmallIntegerField(null=True, blank=True)
    cpu_tdp_w = models.FloatField(null=True, blank=True, help_text="Operator's CPU TDP for this node (all sockets).")
    cpu_tdp_w_model = models.FloatField(null=True, blank=True, help_text="From the CPU model table (all sockets).")
    # energy accumulators: long-lived, not bounded by the metrics retention
    cpu_energy_wh_estimate = models.FloatField(default=0.0, db_default=0.0)
    cpu_power_w_estimate = models.FloatField(null=True, blank=True)
    cpu_power_at = models.DateTimeField(null=True, blank=True)
    # carbon: the node's own factor overrides its region's (EmissionFactor)
    emission_factor_g_per_kwh = models.FloatField(null=True, blank=True)
    # the hash of the beat's gpu_health: a beat whose hash differs takes the health step
    health_hash = models.CharField(max_length=32, blank=True, default="", db_default="")
    # bookkeeping
    structure_hash = models.CharField(max_length=32, blank=True, default="")
    version = models.PositiveIntegerField(default=1, help_text="Optimistic concurrency for operator changes.")
    registered_at = models.DateTimeField(auto_now_add=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # set by the agent's farewell beat (SIGTERM): offline at once, until it beats again
    signed_off_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = NodeQuerySet.as_manager()

    class Meta:
        db_table = "nodes"
        ordering = ["name", "id"]
        indexes = [
            models.Index(fields=["status"], name="nodes_status"),
            models.Index(fields=["last_heartbeat_at"], name="nodes_last_heartbeat"),
            models.Index(fields=["name", "id"], name="nodes_name_id"),  # the list's order
            # the list's filter (a plain index: db_index would add a LIKE twin each beat writes)
            models.Index(fields=["gpu_type"], name="nodes_gpu_type"),
            # the alert sweep's driver errors: the failing nodes, not the fleet
            models.Index(fields=["id"], condition=~Q(gpu_collector_error=""), name="nodes_gpu_collector_failing"),
        ]

    def __str__(self):
        return self.name

    def status_at(self, now: datetime) -> str:
        return liveness.status_at(
            self.last_heartbeat_at,
            self.executable,
            now,
            signed_off_at=self.signed_off_at,
            gpu_failing=bool(self.gpu_collector_error),
        )


class GpuQuerySet(models.QuerySet):
    def with_state(self):
        """The cards with `held` (the scheduler's ledger has a holder on the card), read
        in the same query as the cards, so that `state` asks nothing more per card. The
        ledger is reached through the node's reverse relation: the scheduler's models
        import these, never the other way."""
        ledger = Node._meta.get_field("allocations").related_model
        return self.annotate(held=Exists(ledger.objects.filter(node=OuterRef("node"), gpu_index=OuterRef("index"))))


class Gpu(models.Model):
    # no index of its own: the (node, index) unique constraint leads with it, and every
    # index a beat's card update must write costs it (docs/architecture.md#hot-paths)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus", db_index=False)
    index = models.PositiveIntegerField()
    uuid = models.CharField(max_length=128, blank=True, default="")
    vendor = models.CharField(max_length=20, default="")
    model = models.CharField(max_length=200, blank=True, default="")
    memory_total_mb = models.BigIntegerField(null=True, blank=True)
    compute_capability = models.CharField(max_length=20, blank=True, default="")
    # which card this row is (apps.nodes.card_identity): its PCI address as the agent
    # reports it, how the beat matches it, and the index the agent reports it under now
    # (not the row's index after the vendor's tool renumbered its cards; null: the agent
    # did not report it when its cards were last matched)
    pci_bus_id = models.CharField(max_length=16, blank=True, default="", db_default="")
    matched_by = models.CharField(
        max_length=12, choices=CardIdentity.choices, default=CardIdentity.INDEX, db_default=CardIdentity.INDEX
    )
    reported_index = models.PositiveSmallIntegerField(null=True, blank=True)
    # latest readings; null = not read (never 0 for "unknown")
    utilization = models.FloatField(null=True, blank=True)
    memory_used_mb = models.BigIntegerField(null=True, blank=True)
    temperature = models.FloatField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    metrics_available = models.JSONField(default=list, blank=True)
    # lost-card judgement, kept in the database so it survives a restart
    absent_streak = models.PositiveSmallIntegerField(default=0)
    absent_basis = models.PositiveSmallIntegerField(default=0, help_text="1: absent from gpu_stats, 2: collect failure")
    present_streak = models.PositiveSmallIntegerField(default=0)
    lost_at = models.DateTimeField(null=True, blank=True)
    lost_basis = models.CharField(max_length=24, choices=LostBasis.choices, blank=True, default="")
    # health (apps.nodes.health): the latest reading; a cordoned card takes no new placement
    health = models.JSONField(default=dict, blank=True, db_default={})
    health_at = models.DateTimeField(null=True, blank=True)
    cordoned_at = models.DateTimeField(null=True, blank=True)
    cordon_source = models.CharField(max_length=10, choices=CordonSource.choices, blank=True, default="", db_default="")
    cordon_reason = models.CharField(max_length=300, blank=True, default="", db_default="")
    cordon_evidence = models.JSONField(default=dict, blank=True, db_default={})
    last_bad_at = models.DateTimeField(null=True, blank=True, help_text="The latest bad health evidence.")
    # measured memory the ledger does not explain (apps.nodes.drift)
    memory_drift_since = models.DateTimeField(null=True, blank=True)
    memory_drift_mb = models.BigIntegerField(null=True, blank=True)
    memory_drift_ended_at = models.DateTimeField(
        null=True, blank=True, help_text="A marked drift's first beat at or under the threshold (it ends a span later)."
    )
    # energy accumulator (Wh), integrated from measured power by the heartbeat
    energy_wh = models.FloatField(default=0.0, db_default=0.0)
    energy_since = models.DateTimeField(null=True, blank=True)
    power_at = models.DateTimeField(null=True, blank=True, help_text="When power was last measured.")
    energy_gap_seconds = models.FloatField(default=0.0, db_default=0.0)
    updated_at = models.DateTimeField(auto_now=True)

    objects = GpuQuerySet.as_manager()

    class Meta:
        db_table = "gpus"
        ordering = ["node_id", "index"]
        constraints = [models.UniqueConstraint(fields=["node", "index"], name="gpu_node_index_unique")]

    def __str__(self):
        return f"{self.node_id}/{self.index} {self.model}"

    @property
    def state(self) -> str:
        """apps.nodes.gpu_state's rule. Read a list of cards with `Gpu.objects.with_state()`;
        a present card read without it asks the ledger on its own."""
        held = getattr(self, "held", None)
        if held is None and self.lost_at is None:
            held = Gpu.objects.with_state().values_list("held", flat=True).get(pk=self.pk)
        return gpu_state(lost=self.lost_at is not None, held=bool(held), cordoned=self.cordoned_at is not None)


class NodeMetric(models.Model):
    """One row per heartbeat: a time series in a table partitioned by day (see migration
    0002). Per-GPU readings are one JSON array, not one row per GPU."""

    id = models.BigAutoField(primary_key=True)
    node_id = models.CharField(max_length=128)
    at = models.DateTimeField()
    cpu_used = models.FloatField(null=True)
    memory_used = models.FloatField(null=True)
    gpus = models.JSONField(default=list)

    class Meta:
        db_table = "node_metrics"
        managed = False


class ImageRequest(models.Model):
    """An operator's image intent for one node's agent (docs/images.md): pull one
    reference, or check up to 32. Claimed by CAS pending → processing and reported like
    a task; a pull reports its progress every minute and is judged stalled only after
    ten minutes without progress (never by its total time, within its 2-hour budget)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="image_requests")
    action = models.CharField(max_length=8, choices=ImageAction.choices)
    # pull: one reference; check: up to 32 (exact tag/digest, or a bare repository)
    references = models.JSONField(default=list)
    status = models.CharField(max_length=12, choices=ImageRequestStatus.choices, default=ImageRequestStatus.PENDING)
    # the agent's latest progress: {"layers_done", "layers_total", "bytes_done", "bytes_total", "message"}
    progress = models.JSONField(default=dict, blank=True)
    progress_at = models.DateTimeField(null=True, blank=True)
    # check: {"images": [{"reference", "present", "size_bytes", "image_id", "tags": [...]}]};
    # pull: the check of the pulled reference that proves it is there
    result = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")
    requested_by = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    deadline = models.DateTimeField(null=True, blank=True, help_text="created_at + the 2-hour budget")
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "image_requests"
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["node", "status", "id"], name="image_requests_poll"),
            models.Index(fields=["status", "updated_at"], name="image_requests_janitor"),
        ]

    def __str__(self):
        return f"{self.action} {', '.join(self.references)[:80]} on {self.node_id} ({self.status})"


class WatchedImage(models.Model):
    """An image the nodes of a GPU vendor should have (engine images per vendor, base
    and training images); empty vendor: every node. The server's list is authoritative
    (`GET /api/v1/nodes/{id}/images/watched`); operators edit it."""

    vendor = models.CharField(max_length=20, blank=True, default="", help_text="Empty: every vendor.")
    reference = models.CharField(max_length=512)
    kind = models.CharField(max_length=10, choices=WatchedImageKind.choices)
    note = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "watched_images"
        ordering = ["vendor", "kind", "reference"]
        constraints = [models.UniqueConstraint(fields=["vendor", "reference"], name="watched_image_unique")]

    def __str__(self):
        return f"{self.vendor or '*'}: {self.reference}"


class GpuHealthSample(models.Model):
    """A card's health reading, kept when it differs from the one before (the beat's
    gpu_health hash), long-lived: the history failure prediction reads. Keyed by node
    and index (not a foreign key) so the history outlives a deleted node. Null: the
    vendor's tool does not report it (never 0)."""

    id = models.BigAutoField(primary_key=True)
    node_id = models.CharField(max_length=128)
    gpu_index = models.PositiveIntegerField()
    gpu_uuid = models.CharField(max_length=128, blank=True, default="")
    vendor = models.CharField(max_length=20, blank=True, default="")
    model = models.CharField(max_length=200, blank=True, default="")
    at = models.DateTimeField()
    ecc_corrected_volatile = models.BigIntegerField(null=True)
    ecc_uncorrected_volatile = models.BigIntegerField(null=True)
    ecc_corrected_aggregate = models.BigIntegerField(null=True)
    ecc_uncorrected_aggregate = models.BigIntegerField(null=True)
    retired_pages_single_bit = models.BigIntegerField(null=True)
    retired_pages_double_bit = models.BigIntegerField(null=True)
    retired_pages_pending = models.BooleanField(null=True)
    remapped_rows_correctable = models.BigIntegerField(null=True)
    remapped_rows_uncorrectable = models.BigIntegerField(null=True)
    remapped_rows_pending = models.BooleanField(null=True)
    remapped_rows_failure = models.BooleanField(null=True)
    xid_events = models.JSONField(default=list, blank=True)  # the events new in this sample
    throttle_reasons = models.JSONField(null=True, blank=True)
    available = models.JSONField(default=list, blank=True)  # what the agent could read
    unhealthy = models.BooleanField(default=False)
    reasons = models.JSONField(default=list, blank=True)

    class Meta:
        db_table = "gpu_health_samples"
        ordering = ["-at", "-id"]
        indexes = [
            models.Index(fields=["node_id", "gpu_index", "at"], name="gpu_health_card_at"),
            models.Index(fields=["model", "at"], name="gpu_health_model_at"),
        ]

    def __str__(self):
        return f"{self.node_id}/{self.gpu_index} at {self.at:%Y-%m-%d %H:%M}"


class EmissionFactor(models.Model):
    """Grid carbon intensity per region (g CO2e per kWh); a node's own factor overrides
    it. No factor: no absolute carbon figure anywhere."""

    region = models.CharField(max_length=64, unique=True)
    g_co2e_per_kwh = models.FloatField()
    source = models.CharField(max_length=200, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "emission_factors"
        ordering = ["region"]

    def __str__(self):
        return f"{self.region}: {self.g_co2e_per_kwh:g} g/kWh"


class EnergyDaily(models.Model):
    """Energy per node, card and UTC day, rolled up from the accumulators (gpu_index -1:
    the node's CPU estimate); long-lived, for trends beyond the metrics window.
    `meter_wh` is the accumulator's value at the latest rollup, from which the next
    rollup's delta is taken."""

    CPU_ESTIMATE = -1

    node_id = models.CharField(max_length=128)
    gpu_index = models.IntegerField()
    day = models.DateField()
    wh = models.FloatField(default=0.0)
    meter_wh = models.FloatField(default=0.0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "energy_daily"
        ordering = ["node_id", "gpu_index", "day"]
        constraints = [
            models.UniqueConstraint(fields=["node_id", "gpu_index", "day"], name="energy_daily_unique"),
        ]
