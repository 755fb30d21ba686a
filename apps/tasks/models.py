"""Tasks: what tenants ask the cluster to run. Status moves only through
apps.core.cas.transition with choices.TRANSITIONS. A task group (multi-worker training)
is a set of ordinary tasks, one per rank, placed and bound all or nothing."""

from __future__ import annotations

from django.conf import settings
from django.contrib.postgres.aggregates import ArrayAgg
from django.db import connections, models
from django.db.models import Q, Value

from apps.core.models import TenantOwned
from apps.core.scoping import ScopedQuerySet
from apps.tasks.choices import (
    HOLDING,
    GroupKind,
    GroupPlacement,
    GroupStrategy,
    InteractiveApp,
    TaskKind,
    TaskRuntime,
    TaskStatus,
    group_status,
)


# A task's and a group's hard placement constraints are the same fields (a group's are
# every member's): one definition of each.
def runtime_field() -> models.CharField:
    return models.CharField(
        max_length=10,
        choices=TaskRuntime.choices,
        default=TaskRuntime.AUTO,
        db_default=TaskRuntime.AUTO,
        help_text="auto: the node's runtime; container: only nodes with a container engine; "
        "process: only nodes that run processes (no image needed)",
    )


def affinity_field() -> models.JSONField:
    return models.JSONField(
        default=dict,
        db_default=Value({}, output_field=models.JSONField()),
        blank=True,
        help_text='{"nodes_with_labels": {"key": "value", ...}}: only nodes with every one of them',
    )


def anti_affinity_field() -> models.JSONField:
    return models.JSONField(
        default=dict,
        db_default=Value({}, output_field=models.JSONField()),
        blank=True,
        help_text='{"labels": {...}}: never nodes with any of them; {"same_service": true}: '
        "no two replicas of one inference service on a node",
    )


class TaskQuerySet(ScopedQuerySet):
    tenant_field = "tenant"

    def in_queue_order(self):
        return self.order_by("-priority", "created_at", "id")


class TaskGroupQuerySet(ScopedQuerySet):
    tenant_field = "tenant"

    def with_status(self):
        """Each group with its members' statuses (`member_statuses`), so `status` needs no
        query per group in a list."""
        return self.annotate(
            member_statuses=ArrayAgg("tasks__status", filter=Q(tasks__isnull=False), default=Value([]))
        )


class TaskGroup(TenantOwned):
    """Workers of one distributed job: `world_size` tasks (Task.group, Task.rank), each
    with `gpus_per_worker` cards of exactly `gpu_type` (never another vendor). Its status
    is derived from its members' (`choices.group_status`), not stored."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="task_groups")
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=10, choices=GroupKind.choices, default=GroupKind.TRAINING)
    strategy = models.CharField(max_length=10, choices=GroupStrategy.choices, default=GroupStrategy.DDP)
    placement = models.CharField(
        max_length=10,
        choices=GroupPlacement.choices,
        default=GroupPlacement.GANG,
        help_text="gang: all members in one cycle or none; replicas: each member placed on its own "
        "(an inference service)",
    )
    world_size = models.PositiveIntegerField(help_text="workers (one task each)")
    gpus_per_worker = models.PositiveIntegerField(default=1)
    gpu_type = models.CharField(max_length=20, help_text="every worker on this vendor's cards, strictly")
    # what every worker runs
    image = models.CharField(max_length=500, blank=True, default="")
    command = models.JSONField(default=list, blank=True, help_text="argv list")
    env = models.JSONField(default=dict, blank=True)
    volumes = models.JSONField(default=list, blank=True)
    checkpoint_path = models.CharField(max_length=1024, blank=True, default="")
    priority = models.PositiveSmallIntegerField(default=50)
    labels = models.JSONField(default=dict, blank=True, help_text="scheduling hints, as for tasks")
    # hard placement constraints, beside the soft scoring hints in `labels`
    # (apps.scheduler.core.filters): which runtime every member accepts, the node labels it
    # needs and the ones (or the siblings) it avoids
    runtime = runtime_field()
    affinity = affinity_field()
    anti_affinity = anti_affinity_field()
    # decided at bind: the backend and addresses the workers use, and why
    network = models.JSONField(default=dict, blank=True, help_text='{"backend", "address", "reason", ...}')
    schedule_reason = models.JSONField(default=dict, blank=True, help_text="why the last cycle did not place it")
    # the scheduler's report while the group is the head of its priority: since when, and
    # the cards held for it once it reserves ({} otherwise; docs/scheduler.md)
    reservation = models.JSONField(
        default=dict, blank=True, help_text='{"state": "waiting"|"holding", "head_since", "nodes", ...} or {}'
    )
    # when it is expected to start while it waits (apps.scheduler.predictions, docs/predictions.md)
    estimated_start = models.JSONField(
        null=True, blank=True, default=None, help_text='{"p50", "p90", "computed_at", "basis"} or null'
    )
    attempts = models.PositiveIntegerField(default=0, help_text="placements so far (a lost worker ends the attempt)")
    # the attempt (1, 2, …) a lost worker has ended; the attempt under way is live while
    # this is below `attempts`. Set once per attempt by one compare-and-set (services.end_group_attempt)
    ended_attempt = models.PositiveIntegerField(default=0, help_text="the last attempt a lost worker ended")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = TaskGroupQuerySet.as_manager()

    class Meta:
        db_table = "task_groups"
        indexes = [
            models.Index(fields=["tenant", "created_at"], name="task_groups_tenant"),
            # the few groups with a reservation report, which each cycle clears when stale
            models.Index(fields=["id"], condition=~models.Q(reservation={}), name="task_groups_reserving"),
            # the inference services' groups, whose members the scheduler's queue takes one
            # by one (apps.scheduler.services.QUEUE_SQL)
            models.Index(
                fields=["id"], condition=models.Q(placement=GroupPlacement.REPLICAS), name="task_groups_replicas"
            ),
        ]
        constraints = [
            models.CheckConstraint(condition=models.Q(priority__lte=100), name="task_group_priority_0_100"),
            models.CheckConstraint(
                condition=models.Q(world_size__gte=1, gpus_per_worker__gte=1), name="task_group_sizes_positive"
            ),
        ]

    @property
    def status(self) -> str:
        statuses = getattr(self, "member_statuses", None)
        if statuses is None:
            statuses = self.tasks.values_list("status", flat=True)
        return group_status(statuses, self.placement)

    def __str__(self):
        return f"{self.name} ({self.world_size} × {self.gpus_per_worker} {self.gpu_type})"


class Task(TenantOwned):
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="tasks")
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=16, choices=TaskKind.choices, default=TaskKind.JOB)
    status = models.CharField(max_length=20, choices=TaskStatus.choices, default=TaskStatus.PENDING)
    # what to run
    image = models.CharField(max_length=500, blank=True, default="")
    command = models.JSONField(default=list, blank=True, help_text="argv list")
    env = models.JSONField(default=dict, blank=True, help_text='{"NAME": "value"} or {"NAME": {"secret": "name"}}')
    volumes = models.JSONField(default=list, blank=True)
    registry_auth = models.JSONField(
        null=True,
        blank=True,
        help_text=(
            'private registry: {"registry", "username", "password": {"secret": "<name>"}}; '
            "the password stays in the tenant's secrets"
        ),
    )
    ports = models.JSONField(default=list, blank=True)
    health_probe = models.JSONField(null=True, blank=True)
    serving = models.JSONField(
        default=dict,
        blank=True,
        help_text='an inference task the agent\'s engine router launches: {"engine": name or "auto", '
        '"model": the name clients use, "format", "source": path / image / hub id, "args": [engine arguments]}',
    )
    # what it needs
    gpu_required = models.PositiveIntegerField(default=1)
    gpu_memory_mb = models.PositiveBigIntegerField(null=True, blank=True)
    gpu_type = models.CharField(max_length=20, blank=True, default="")
    cpu_request = models.FloatField(null=True, blank=True, help_text="cores")
    memory_request_mb = models.PositiveBigIntegerField(null=True, blank=True)
    priority = models.PositiveSmallIntegerField(default=50)
    preemptible = models.BooleanField(default=False)
    labels = models.JSONField(default=dict, blank=True, help_text="scheduling hints")
    # hard placement constraints, beside the soft scoring hints in `labels`
    # (apps.scheduler.core.filters): which runtime the task accepts, the node labels it
    # needs and the ones (or the siblings) it avoids
    runtime = runtime_field()
    affinity = affinity_field()
    anti_affinity = anti_affinity_field()
    timeout_seconds = models.PositiveIntegerField(default=7_200)
    # how long it says it runs at most: it is stopped past it, as past its timeout, and a
    # task that declares it may run on cards a waiting group's reservation holds when it
    # ends before they are expected free (backfill, docs/queues.md#backfill)
    max_duration_seconds = models.PositiveIntegerField(null=True, blank=True)
    checkpoint_path = models.CharField(max_length=1024, blank=True, default="")
    resume_from_checkpoint = models.CharField(max_length=1024, blank=True, default="")
    # an interactive task (docs/interactive.md): its app, the token the app asks for (never
    # in the task's API object: GET /tasks/{id}/app gives it to those who may enter), how
    # long it may sit idle before it is stopped, and when its owner was warned of that
    app = models.CharField(max_length=16, choices=InteractiveApp.choices, blank=True, default="", db_default="")
    app_token = models.CharField(max_length=64, blank=True, default="", db_default="")
    idle_minutes = models.PositiveIntegerField(null=True, blank=True)
    idle_warned_at = models.DateTimeField(null=True, blank=True)
    # a worker of a task group, and its rank in it (0 is the master)
    group = models.ForeignKey(TaskGroup, null=True, blank=True, on_delete=models.CASCADE, related_name="tasks")
    rank = models.PositiveIntegerField(null=True, blank=True)
    # where and how it went
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.PROTECT, related_name="tasks")
    host_port = models.PositiveIntegerField(
        null=True, blank=True, help_text="inference: the node's port (8000-8999) the service is published on"
    )
    preempt_count = models.PositiveIntegerField(default=0)
    exit_code = models.IntegerField(null=True, blank=True)
    error_message = models.TextField(blank=True, default="")
    log_tail = models.TextField(
        blank=True, default="", help_text="the last lines of output, from the agent's final report"
    )
    schedule_reason = models.JSONField(default=dict, blank=True, help_text="why the last cycle did not place it")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # when it is expected to start while it waits; and the accuracy record: its first
    # estimate, then one per hour of waiting, kept after it starts beside started_at
    # (apps.scheduler.predictions, docs/predictions.md)
    estimated_start = models.JSONField(
        null=True, blank=True, default=None, help_text='{"p50", "p90", "computed_at", "basis"} or null'
    )
    estimate_samples = models.JSONField(
        null=True,
        blank=True,
        default=None,
        help_text='[{"computed_at", "p50", "p90"}]: the first estimate, then one per hour of waiting',
    )
    # GPU time: each run (claim to requeue or end) adds gpu_required × its length; the
    # total is settled once, when the task ends (UsageRecord)
    running_since = models.DateTimeField(
        null=True, blank=True, help_text="start of the run not yet counted in gpu_seconds"
    )
    gpu_seconds = models.FloatField(default=0.0)
    # energy of the cards it held, from their accumulators' growth while held (null: no
    # power measured on them); carbon where its node had an emission factor, and the
    # energy used where none was configured (apps.nodes.energy)
    energy_wh = models.FloatField(null=True, blank=True)
    carbon_g = models.FloatField(null=True, blank=True)
    energy_wh_unfactored = models.FloatField(default=0.0, db_default=0.0)
    # running here but absent from its node's live_task_ids since (the stalled-task check)
    missing_since = models.DateTimeField(null=True, blank=True)
    # a member of an array (POST /api/v1/tasks/batch): its index 0…size-1, handed to the
    # run as HETEROFLOW_ARRAY_INDEX / HETEROFLOW_ARRAY_SIZE (services.resolve_env)
    array_index = models.PositiveIntegerField(null=True, blank=True)
    array_size = models.PositiveIntegerField(null=True, blank=True)

    objects = TaskQuerySet.as_manager()

    class Meta:
        db_table = "tasks"
        indexes = [
            models.Index(fields=["tenant", "status"], name="tasks_tenant_status"),
            models.Index(fields=["node", "status"], name="tasks_node_status"),
            # the queue: pending tasks by priority, then age
            models.Index(fields=["status", "-priority", "created_at", "id"], name="tasks_queue"),
            # the groups waiting to be placed, found without reading the singles' queue
            models.Index(
                fields=["group"],
                condition=models.Q(status=TaskStatus.PENDING, group__isnull=False),
                name="tasks_pending_group_members",
            ),
            # the tasks carrying a start estimate (the waiting ones, and those that left the
            # queue since the last run): the estimates job clears the latter without reading
            # every task (apps.scheduler.predictions)
            models.Index(fields=["id"], condition=models.Q(estimated_start__isnull=False), name="tasks_estimated"),
        ]
        constraints = [
            models.CheckConstraint(condition=models.Q(priority__lte=100), name="task_priority_0_100"),
            # a host port serves one task at a time on a node (kept for history once ended)
            models.UniqueConstraint(
                fields=["node", "host_port"],
                condition=models.Q(status__in=HOLDING, host_port__isnull=False),
                name="task_host_port_once_per_node",
            ),
            models.CheckConstraint(
                condition=~models.Q(kind=TaskKind.TRAINING, preemptible=True), name="task_training_not_preemptible"
            ),
            models.UniqueConstraint(
                fields=["group", "rank"], condition=models.Q(group__isnull=False), name="task_one_rank_per_group"
            ),
            models.CheckConstraint(
                condition=models.Q(group__isnull=True) | models.Q(rank__isnull=False), name="task_group_member_has_rank"
            ),
        ]

    def __str__(self):
        return f"{self.name} ({self.status})"


class TaskEvent(models.Model):
    """Something that happened to a task, kept for its history: an agent's checkpoint
    decision, a requeue, a fault. Appended only."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=40)
    message = models.TextField(max_length=2000)
    details = models.JSONField(default=dict, blank=True)
    node = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "task_events"
        ordering = ["created_at", "id"]
        indexes = [models.Index(fields=["task", "created_at"], name="task_events_by_task")]


class UsageRecord(TenantOwned):
    """The GPU time a task used, settled once when it ended (the unique task says once)."""

    task = models.OneToOneField(Task, on_delete=models.CASCADE, related_name="usage")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="usage_records")
    gpus = models.PositiveIntegerField()
    gpu_seconds = models.FloatField()
    energy_wh = models.FloatField(null=True, blank=True)
    carbon_g = models.FloatField(null=True, blank=True)
    energy_wh_unfactored = models.FloatField(default=0.0, db_default=0.0)
    ended_status = models.CharField(max_length=20)
    settled_at = models.DateTimeField()

    class Meta:
        db_table = "usage_records"
        indexes = [models.Index(fields=["tenant", "settled_at"], name="usage_by_tenant")]

    def __str__(self):
        return f"task {self.task_id}: {self.gpu_seconds:.0f} GPU-s"


class TenantUsageQuerySet(ScopedQuerySet):
    def locked(self, tenant_id: int) -> TenantUsage:
        """The tenant's usage row, locked (FOR UPDATE) until the transaction ends: the
        per-tenant critical section of task creation and tenant deletion. A tenant that
        never had a task gets its zero row here."""
        with connections[self.db].cursor() as cursor:  # the submission hot path: no query to build
            cursor.execute(
                "SELECT tasks, gpus, gpu_memory_mb FROM tenant_usage WHERE tenant_id = %s FOR UPDATE", [tenant_id]
            )
            counts = cursor.fetchone()
        columns = ["tenant_id", "tasks", "gpus", "gpu_memory_mb"]
        row = None if counts is None else self.model.from_db(self.db, columns, [tenant_id, *counts])
        if row is None:
            self.bulk_create([TenantUsage(tenant_id=tenant_id)], ignore_conflicts=True)
            row = self.select_for_update().get(tenant_id=tenant_id)
        return row


class TenantUsage(TenantOwned):
    """What a tenant's active (non-terminal) tasks hold, the quota's usage kept as a
    counter so that a create checks a row instead of counting the tasks.

    Kept by triggers on `tasks` (migration 0011), in the same statement's transaction as
    the task rows, whatever writes them: a create, a bulk insert, a move to a terminal
    status, a delete, an edit of a task's GPUs. Written only by them; read through
    `services.quota_use` and locked through `TenantUsage.objects.locked`."""

    tenant = models.OneToOneField(
        "tenants.Tenant", primary_key=True, on_delete=models.CASCADE, related_name="quota_usage"
    )
    tasks = models.BigIntegerField(default=0, help_text="active tasks")
    gpus = models.BigIntegerField(default=0, help_text="GPUs the active tasks ask for")
    gpu_memory_mb = models.BigIntegerField(default=0, help_text="GPU memory they ask for, per GPU asked")

    objects = TenantUsageQuerySet.as_manager()

    class Meta:
        db_table = "tenant_usage"

    def __str__(self):
        return f"tenant {self.tenant_id}: {self.tasks} tasks, {self.gpus} GPUs"

    def as_use(self) -> dict:
        return {"tasks": self.tasks, "gpus": self.gpus, "gpu_memory_mb": self.gpu_memory_mb}


class TaskLogState(models.Model):
    """Where a task's live log stands (apps.tasks.logs): the agent's run that writes it and
    that run's next line, the task's next sequence number, and what is stored. One row a
    task, written only by the log ingestion (one batch at a time, rows locked in task id
    order) and the trim job. The lines themselves are in `task_log_chunks`, a row per
    task and agent batch, partitioned by day (migration 0020), read in SQL."""

    task = models.OneToOneField(Task, primary_key=True, on_delete=models.CASCADE, related_name="log_state")
    run = models.CharField(max_length=64, default="", help_text="the agent's id of the run now writing")
    base = models.BigIntegerField(default=1, help_text="the task's sequence number of that run's first line")
    run_next = models.BigIntegerField(default=0, help_text="the run's next line (its own numbering)")
    next_seq = models.BigIntegerField(default=1, help_text="the task's next sequence number (the first is 1)")
    first_seq = models.BigIntegerField(default=1, help_text="lines before it were trimmed")
    stored_bytes = models.BigIntegerField(default=0)
    dropped_bytes = models.BigIntegerField(default=0, help_text="over the agent's rate limit, not sent")
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "task_log_state"

    def __str__(self):
        return f"task {self.task_id}: lines {self.first_seq}-{self.next_seq - 1}, {self.stored_bytes} bytes"
