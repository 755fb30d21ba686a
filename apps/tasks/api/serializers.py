import re
from datetime import UTC, timedelta

from django.conf import settings
from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.core.clock import utcnow
from apps.core.error_codes import CoreErrorCode
from apps.core.pagination import LIMIT_HELP, MAX_LIMIT, PageQuerySerializer
from apps.core.serializers import AgentPayloadSerializer, StrictSerializer
from apps.inference.choices import Engine, ModelFormat  # the schema layer: constants any app may use
from apps.nodes.choices import GpuVendor
from apps.slices.choices import Qos, SliceState, Tier
from apps.tasks import logs
from apps.tasks.choices import (
    DEFAULT_PRIORITY,
    MAX_GPUS_PER_TASK,
    MAX_PRIORITY,
    MAX_SELECTOR_LABELS,
    MAX_TASK_SECONDS,
    MIN_PRIORITY,
    NODE_LABEL_KEY,
    NODE_LABEL_VALUE_MAX,
    GroupKind,
    GroupStatus,
    GroupStrategy,
    InteractiveApp,
    TaskKind,
    TaskRuntime,
    TaskStatus,
)
from apps.tasks.models import Task, TaskGroup
from apps.tasks.selectors import task_slice

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


class EnvValueField(serializers.JSONField):
    """A string, or {"secret": "<name of a secret of the tenant>"}."""


class VolumeSerializer(StrictSerializer):
    host = serializers.CharField(max_length=1024)
    container = serializers.CharField(max_length=1024)
    read_only = serializers.BooleanField(default=False)


class SecretReferenceSerializer(StrictSerializer):
    secret = serializers.CharField(max_length=200)


class RegistryAuthSerializer(StrictSerializer):
    """Credentials for pulling the task's image from a private registry. The password is
    a reference to one of the tenant's secrets: it is resolved when the agent fetches
    the task and is never stored with the task."""

    registry = serializers.CharField(max_length=253, help_text="e.g. registry.example.com:5000")
    username = serializers.CharField(max_length=200)
    password = SecretReferenceSerializer()


class HealthProbeSerializer(StrictSerializer):
    type = serializers.ChoiceField(choices=[("http", "http"), ("tcp", "tcp")])
    port = serializers.IntegerField(min_value=1, max_value=65535)
    path = serializers.CharField(max_length=500, required=False, default="/health")


AUTO_ENGINE = "auto"


class ServingSerializer(StrictSerializer):
    """What an inference task serves, for the agent's engine router: the engine ("auto":
    the router chooses from the node's engines and the model's format), the model's name
    as clients ask for it, its format, where its weights are, and the engine's extra
    arguments."""

    engine = serializers.ChoiceField(
        choices=[AUTO_ENGINE, *Engine.values],
        default=AUTO_ENGINE,
        error_messages={
            "invalid_choice": f'"{{input}}" is not an engine: "{AUTO_ENGINE}" or one of {", ".join(Engine.values)}.'
        },
    )
    model = serializers.CharField(max_length=200, help_text='the name clients put in "model"')
    format = serializers.ChoiceField(
        choices=ModelFormat.choices,  # the registry's own choice set: one enum in the API schema
        error_messages={
            "invalid_choice": f'"{{input}}" is not a model format: one of {", ".join(ModelFormat.values)}.'
        },
    )
    source = serializers.CharField(max_length=1024, help_text="a path on the nodes' model cache, an image or a hub id")
    args = serializers.ListField(
        child=serializers.CharField(max_length=10_000), required=False, default=list, max_length=1000
    )


class NodeLabelsField(serializers.DictField):
    """Node labels a placement constraint names, {"key": "value", ...}: keys spelled as
    node labels are (`key_pattern`), at least one and at most MAX_SELECTOR_LABELS
    (`max_keys`; the job file's schema reads both)."""

    key_pattern = NODE_LABEL_KEY
    max_keys = MAX_SELECTOR_LABELS

    def __init__(self, **kwargs):
        kwargs.setdefault("child", serializers.CharField(max_length=NODE_LABEL_VALUE_MAX, allow_blank=True))
        kwargs.setdefault("allow_empty", False)
        super().__init__(**kwargs)
        self.error_messages["empty"] = "Name at least one label, or leave this out."

    def to_internal_value(self, data):
        labels = super().to_internal_value(data)
        problems = [f"{key!r} is not a node label's name" for key in labels if not re.match(self.key_pattern, key)]
        if len(labels) > self.max_keys:
            problems.append(f"At most {self.max_keys} labels.")
        if problems:
            raise serializers.ValidationError(problems)
        return dict(labels)


class AffinitySerializer(StrictSerializer):
    """Hard node affinity: the task goes only to nodes that carry every one of these
    labels, with these values (a filter, not a preference: with none, it waits)."""

    nodes_with_labels = NodeLabelsField(required=False, help_text="only nodes with every one of these labels")


class AntiAffinitySerializer(StrictSerializer):
    """Hard anti-affinity: never on a node with any of `labels`; with `same_service`, never
    on a node that already holds another replica of the same inference service (beside
    the replica-spread score, which only prefers apart)."""

    same_service = serializers.BooleanField(
        required=False, default=False, help_text="an inference service's replicas: no two on one node"
    )
    labels = NodeLabelsField(required=False, help_text="never a node with any of these labels")


def constraints_problems(attrs: dict, *, replicas: bool) -> dict:
    """The placement constraints of a task, a group or a service, checked together and
    stored as asked (`same_service` only when true, nothing for an empty selector);
    `replicas`: the body describes an inference service's replicas, the only members
    `same_service` can keep apart. Returns the problems by field ({} when none)."""
    problems: dict = {}
    for name in ("affinity", "anti_affinity"):
        if name in attrs:
            attrs[name] = {key: value for key, value in dict(attrs[name]).items() if value}
    wanted = attrs.get("affinity", {}).get("nodes_with_labels", {})
    avoided = attrs.get("anti_affinity", {}).get("labels", {})
    both = sorted(f"{key}={value}" for key, value in avoided.items() if wanted.get(key) == value)
    if both:
        problems.setdefault("anti_affinity", {})["labels"] = [
            f"Asked for and avoided at once, so no node could take it: {', '.join(both)}."
        ]
    if attrs.get("anti_affinity", {}).get("same_service") and not replicas:
        problems.setdefault("anti_affinity", {})["same_service"] = [
            "Only an inference service's replicas have a service to keep apart from; "
            "use anti_affinity.labels to keep this off nodes."
        ]
    return problems


IMAGE_REQUIRED = "This field is required (it may be left out only with runtime process)."


def image_problems(attrs: dict) -> dict:
    """A task (or a group's workers) under the process runtime needs no image and can
    mount no volume (there is no container to mount it in); any other needs an image,
    but an interactive one where the operator set the image interactive tasks start in."""
    problems: dict = {}
    if attrs.get("runtime") == TaskRuntime.PROCESS:
        if attrs.get("volumes"):
            problems["volumes"] = [
                "The process runtime cannot mount volumes (no container to mount them in); "
                "use host paths in the command, or runtime container."
            ]
    elif not attrs.get("image") and not image_by_default(attrs):
        problems["image"] = [IMAGE_REQUIRED]
    return problems


def image_by_default(data) -> bool:
    """An interactive task may leave its image out where the operator set one per vendor
    (HETEROFLOW_INTERACTIVE_IMAGES): the node it lands on starts it in its vendor's."""
    return data.get("kind") == TaskKind.INTERACTIVE and bool(settings.HETEROFLOW_INTERACTIVE_IMAGES)


def interactive_problems(attrs: dict) -> dict:
    """An interactive task's app is its command, and it alone has an app, an idle time and
    max_hours (its max_duration_seconds in hours: one of the two)."""
    problems: dict = {}
    interactive = ("app", "idle_minutes", "max_hours")
    if attrs["kind"] != TaskKind.INTERACTIVE:
        for name in interactive:
            if attrs.get(name) not in (None, ""):
                problems[name] = ["Only interactive tasks (kind interactive) have this."]
        return problems
    if attrs.get("command"):
        problems["command"] = ["An interactive task runs its app; give no command (app: jupyter or shell)."]
    if attrs.get("max_hours") is not None and attrs.get("max_duration_seconds") is not None:
        problems["max_hours"] = ["Give max_hours or max_duration_seconds, not both."]
    return problems


class ImageUnlessProcess:
    """Names a missing image with the other fields' errors (a body with several problems
    gets them all at once), though whether it is missing depends on `runtime`."""

    def to_internal_value(self, data):
        try:
            return super().to_internal_value(data)
        except serializers.ValidationError as error:
            if isinstance(error.detail, dict) and isinstance(data, dict) and "image" not in error.detail:
                image = data.get("image")
                if (
                    data.get("runtime") != TaskRuntime.PROCESS
                    and not (isinstance(image, str) and image.strip())
                    and not image_by_default(data)
                ):
                    error.detail["image"] = [serializers.ErrorDetail(IMAGE_REQUIRED, code=CoreErrorCode.REQUIRED)]
            raise


RUNTIME_HELP = (
    "which runtime it accepts: auto (the default) whatever the node has; container only nodes with a "
    "container engine; process only nodes that run processes (then no image is needed)"
)


class TaskCreateSerializer(ImageUnlessProcess, StrictSerializer):
    tenant = serializers.CharField(required=False, help_text="Tenant slug; operators only, defaults to yours.")
    name = serializers.CharField(max_length=200)
    kind = serializers.ChoiceField(choices=TaskKind.choices, default=TaskKind.JOB)
    runtime = serializers.ChoiceField(choices=TaskRuntime.choices, default=TaskRuntime.AUTO, help_text=RUNTIME_HELP)
    image = serializers.CharField(
        max_length=500, required=False, allow_blank=True, default="", help_text="required unless runtime is process"
    )
    command = serializers.ListField(
        child=serializers.CharField(max_length=10_000), required=False, default=list, max_length=1000
    )
    env = serializers.DictField(child=EnvValueField(), required=False, default=dict)
    volumes = VolumeSerializer(many=True, required=False, default=list)
    registry_auth = RegistryAuthSerializer(required=False, allow_null=True, default=None)
    ports = serializers.ListField(
        child=serializers.IntegerField(min_value=1, max_value=65535), required=False, default=list, max_length=16
    )
    health_probe = HealthProbeSerializer(required=False, allow_null=True, default=None)
    serving = ServingSerializer(required=False, help_text="inference tasks only: what the engine router launches")
    gpu_required = serializers.IntegerField(min_value=0, max_value=MAX_GPUS_PER_TASK, default=1)
    gpu_memory_mb = serializers.IntegerField(min_value=1, required=False, allow_null=True, default=None)
    gpu_type = serializers.CharField(max_length=20, required=False, allow_blank=True, default="")
    cpu_request = serializers.FloatField(min_value=0, required=False, allow_null=True, default=None)
    memory_request_mb = serializers.IntegerField(min_value=0, required=False, allow_null=True, default=None)
    priority = serializers.IntegerField(min_value=MIN_PRIORITY, max_value=MAX_PRIORITY, default=DEFAULT_PRIORITY)
    preemptible = serializers.BooleanField(default=False)
    labels = serializers.DictField(
        child=serializers.CharField(max_length=1024, allow_blank=True), required=False, default=dict
    )
    affinity = AffinitySerializer(required=False, help_text="hard: only nodes with these labels")
    anti_affinity = AntiAffinitySerializer(required=False, help_text="hard: never nodes with these labels")
    timeout_seconds = serializers.IntegerField(min_value=1, max_value=MAX_TASK_SECONDS, required=False)
    max_duration_seconds = serializers.IntegerField(
        min_value=1,
        max_value=MAX_TASK_SECONDS,
        required=False,
        allow_null=True,
        help_text="how long it runs at most (at most its timeout): stopped past it; lets it backfill reserved cards",
    )
    checkpoint_path = serializers.CharField(max_length=1024, required=False, allow_blank=True, default="")
    resume_from_checkpoint = serializers.CharField(max_length=1024, required=False, allow_blank=True, default="")
    app = serializers.ChoiceField(
        choices=InteractiveApp.choices, required=False, help_text="interactive tasks: what runs (default jupyter)"
    )
    idle_minutes = serializers.IntegerField(
        min_value=1,
        required=False,
        allow_null=True,
        help_text="interactive tasks: stopped after this long idle (default and ceiling: the tenant's)",
    )
    max_hours = serializers.FloatField(
        min_value=0.1,
        max_value=MAX_TASK_SECONDS / 3600,
        required=False,
        allow_null=True,
        help_text="interactive tasks: how long it runs at most (HETEROFLOW_INTERACTIVE_MAX_HOURS by default)",
    )

    def validate_env(self, env):
        problems = []
        for name, value in env.items():
            if not ENV_NAME.match(name):
                problems.append(f"{name!r} is not a valid variable name")
            elif isinstance(value, dict):
                if set(value) != {"secret"} or not isinstance(value["secret"], str) or not value["secret"]:
                    problems.append(f'{name}: a reference is {{"secret": "<name>"}}')
            elif not isinstance(value, str):
                problems.append(f"{name}: values are strings or secret references")
        if problems:
            raise serializers.ValidationError(problems)
        return env

    def validate(self, attrs):
        if attrs["kind"] == TaskKind.TRAINING and attrs["preemptible"]:
            raise serializers.ValidationError({"preemptible": ["Training tasks cannot be preemptible."]})
        if attrs["kind"] != TaskKind.INFERENCE and attrs.get("health_probe"):
            raise serializers.ValidationError({"health_probe": ["Only inference tasks have a health probe."]})
        if "serving" in attrs:
            if attrs["kind"] != TaskKind.INFERENCE:
                raise serializers.ValidationError({"serving": ["Only inference tasks have a serving spec."]})
            attrs["serving"] = dict(attrs["serving"])
        problems = image_problems(attrs) | constraints_problems(attrs, replicas=False) | interactive_problems(attrs)
        if problems:
            raise serializers.ValidationError(problems)
        if attrs["kind"] == TaskKind.INTERACTIVE:
            attrs.setdefault("app", InteractiveApp.JUPYTER)
        return attrs


class ArraySerializer(StrictSerializer):
    count = serializers.IntegerField(
        min_value=1,
        help_text="how many tasks: indices 0…count-1 (at most HETEROFLOW_TASK_BATCH_MAX, 10,000 by default)",
    )

    def validate_count(self, count):
        if count > settings.HETEROFLOW_TASK_BATCH_MAX:
            raise serializers.ValidationError(
                f"Ensure this value is less than or equal to {settings.HETEROFLOW_TASK_BATCH_MAX}."
            )
        return count


# What a resubmission may change: the fields explain's suggestions name
# (docs/predictions.md#suggestions).
RESUBMIT_FIELDS = ("gpu_required", "gpu_type", "gpu_memory_mb", "labels", "affinity", "anti_affinity", "runtime")
# The create fields a task's own columns do not give back as they were submitted.
NOT_RESUBMITTED = frozenset({"tenant", "max_hours"})


class TaskResubmitSerializer(StrictSerializer):
    change = serializers.DictField(
        allow_empty=False, help_text=f"the fields to change, of: {', '.join(RESUBMIT_FIELDS)}"
    )

    def validate_change(self, value):
        unknown = sorted(set(value) - set(RESUBMIT_FIELDS))
        if unknown:
            raise serializers.ValidationError(
                f"Only {', '.join(RESUBMIT_FIELDS)} can be changed; not {', '.join(unknown)}."
            )
        return value


def submission_of(task, change: dict) -> dict:
    """The create body that submits `task` again with `change`: its own submitted fields,
    as POST /api/v1/tasks takes them, with those replaced (a null affinity or
    anti-affinity: none)."""
    body = {}
    for name in TaskCreateSerializer().fields:
        if name in NOT_RESUBMITTED or name == "serving" and task.kind != TaskKind.INFERENCE:
            continue
        value = getattr(task, name, None)
        if value not in (None, {}, ""):
            body[name] = value
    for name, value in change.items():
        if value is None:
            body.pop(name, None)
        else:
            body[name] = value
    return body


class TaskArraySerializer(TaskCreateSerializer):
    """A task body as POST /api/v1/tasks takes it, plus `array`: that many copies of the
    task, each with its index (HETEROFLOW_ARRAY_INDEX) and the count (HETEROFLOW_ARRAY_SIZE)
    in its environment."""

    array = ArraySerializer()


class TaskBatchCreatedSerializer(serializers.Serializer):
    count = serializers.IntegerField()
    ids = serializers.ListField(child=serializers.IntegerField(), help_text="in array index order")


class EstimatedStartSerializer(serializers.Serializer):
    """When waiting work is expected to start (docs/predictions.md): p50 null means it
    cannot be predicted, and the basis says why."""

    p50 = serializers.DateTimeField(allow_null=True, help_text="the median start; null: no estimate")
    p90 = serializers.DateTimeField(allow_null=True, help_text="starts by then 9 times in 10; null: past the horizon")
    computed_at = serializers.DateTimeField()
    basis = serializers.CharField(help_text="what the estimate rests on, or why there is none")


ESTIMATED_START = EstimatedStartSerializer(
    allow_null=True, help_text="while pending: when it is expected to start (docs/predictions.md); else null"
)


class TaskSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    estimated_start = serializers.SerializerMethodField()

    class Meta:
        model = Task
        fields = [
            "id",
            "tenant",
            "name",
            "kind",
            "status",
            "image",
            "command",
            "env",
            "volumes",
            "ports",
            "health_probe",
            "serving",
            "registry_auth",
            "gpu_required",
            "gpu_memory_mb",
            "gpu_type",
            "cpu_request",
            "memory_request_mb",
            "priority",
            "preemptible",
            "labels",
            "runtime",
            "affinity",
            "anti_affinity",
            "timeout_seconds",
            "max_duration_seconds",
            "checkpoint_path",
            "resume_from_checkpoint",
            "app",
            "idle_minutes",
            "node",
            "host_port",
            "preempt_count",
            "exit_code",
            "error_message",
            "schedule_reason",
            "created_by",
            "created_at",
            "updated_at",
            "started_at",
            "finished_at",
            "gpu_seconds",
            "array_index",
            "array_size",
            "estimated_start",
        ]

    @extend_schema_field(ESTIMATED_START)
    def get_estimated_start(self, task) -> dict | None:
        # the periodic job clears it once the task leaves the queue; until then it is stale
        return task.estimated_start if task.status == TaskStatus.PENDING else None


class TaskSliceSerializer(serializers.Serializer):
    """A memory-only task's slice (apps.slices): its tier, limits and state."""

    id = serializers.IntegerField()
    tier = serializers.ChoiceField(choices=Tier.choices)
    qos = serializers.ChoiceField(choices=Qos.choices, help_text="derived from the tier, never chosen")
    state = serializers.ChoiceField(choices=SliceState.choices)
    gpu_index = serializers.IntegerField()
    gpu_uuid = serializers.CharField()
    memory_mb = serializers.IntegerField(help_text="the memory limit (MIG: the profile's memory)")
    memory_total_mb = serializers.IntegerField(allow_null=True, help_text="the card's")
    compute_percent = serializers.IntegerField(allow_null=True)
    profile = serializers.CharField(help_text="the MIG profile, empty for the other tiers")
    device_id = serializers.CharField(help_text="once confirmed: the MIG device's UUID, else the card's")
    reason = serializers.DictField(help_text='why this tier: {"tier", "qos", "why"}')


class TaskDetailSerializer(TaskSerializer):
    slice = serializers.SerializerMethodField(help_text="a memory-only task's slice; null for the others")

    class Meta(TaskSerializer.Meta):
        fields = [*TaskSerializer.Meta.fields, "slice"]

    @extend_schema_field(TaskSliceSerializer(allow_null=True))
    def get_slice(self, task) -> dict | None:
        return task_slice(task)


AGENT_DEFAULT_LIMIT = 20
AGENT_MAX_LIMIT = 100


class TaskListQuerySerializer(PageQuerySerializer):
    """People page with limit/offset; the agent key takes `limit` alone (at most 100, its
    channel is not paged)."""

    status = serializers.ChoiceField(choices=TaskStatus.choices, required=False)
    kind = serializers.ChoiceField(choices=TaskKind.choices, required=False)
    node_id = serializers.CharField(max_length=128, required=False)
    active = serializers.BooleanField(required=False, help_text="true: only tasks that have not ended")
    ordering = serializers.ChoiceField(
        choices=[("queue", "priority, then age"), ("newest", "newest first")],
        required=False,
        default="queue",
        help_text="queue (the default: priority, then age) or newest",
    )
    limit = serializers.IntegerField(
        min_value=1,
        max_value=MAX_LIMIT,
        required=False,
        help_text=f"{LIMIT_HELP} The agent key: at most {AGENT_MAX_LIMIT} tasks "
        f"(default {AGENT_DEFAULT_LIMIT}), not paged.",
    )


LOG_TAIL_MAX_CHARS = 64 * 1024


class AgentReportSerializer(AgentPayloadSerializer):
    channel = "report"

    node_id = serializers.CharField(max_length=128)
    from_status = serializers.ChoiceField(choices=TaskStatus.choices)
    status = serializers.ChoiceField(choices=TaskStatus.choices)
    exit_code = serializers.IntegerField(required=False, allow_null=True, default=None)
    error_message = serializers.CharField(required=False, allow_blank=True, default="", max_length=10_000)
    log_tail = serializers.CharField(
        required=False,
        allow_blank=True,
        default="",
        max_length=LOG_TAIL_MAX_CHARS,
        trim_whitespace=False,
        help_text="the last lines of output, with a terminal report",
    )
    attempt = serializers.IntegerField(
        required=False,
        allow_null=True,
        default=None,
        min_value=0,
        help_text="a task group member: the group's attempt the report is about, as handed out",
    )


DURATION = re.compile(r"^(\d+)([smhd])$")
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_seconds(text: str) -> int | None:
    """`90s`, `10m`, `2h`, `1d` in seconds; None for anything else."""
    found = DURATION.match(str(text).strip())
    return int(found[1]) * DURATION_UNITS[found[2]] if found else None


@extend_schema_field({"type": "string", "example": "10m"})
class WindowField(serializers.Field):
    """A span back from now: `90s`, `10m`, `2h`, `1d`."""

    default_error_messages = {"invalid": "A duration such as 90s, 10m, 2h or 1d, at most {max}."}

    def __init__(self, *, max_seconds: int, **kwargs):
        self.max_seconds = max_seconds
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        seconds = duration_seconds(data)
        if not seconds or seconds > self.max_seconds:
            self.fail("invalid", max=f"{self.max_seconds // 3600} h")
        return seconds

    def to_representation(self, value):
        return f"{value}s"


@extend_schema_field({"type": "string", "example": "10m"})
class SinceField(serializers.Field):
    """A moment: ISO 8601, or a duration back from now (`90s`, `10m`, `2h`, `1d`)."""

    default_error_messages = {"invalid": "An ISO 8601 time, or a duration such as 90s, 10m, 2h or 1d."}

    def to_internal_value(self, data):
        text = str(data).strip()
        seconds = duration_seconds(text)
        if seconds is not None:
            return utcnow() - timedelta(seconds=seconds)
        moment = parse_datetime(text)
        if moment is None:
            self.fail("invalid")
        return moment if moment.tzinfo else moment.replace(tzinfo=UTC)

    def to_representation(self, value):
        return value.isoformat()


class TaskLogsQuerySerializer(serializers.Serializer):
    after = serializers.IntegerField(
        required=False,
        default=0,
        min_value=0,
        help_text="lines after this sequence number (`next` of a page; lines are numbered from 1)",
    )
    tail = serializers.IntegerField(required=False, min_value=1, max_value=logs.MAX_PAGE, help_text="the last N lines")
    since = SinceField(required=False, help_text="lines read at or after this time (ISO 8601, or 90s, 10m, 2h, 1d)")
    limit = serializers.IntegerField(required=False, default=logs.DEFAULT_PAGE, min_value=1, max_value=logs.MAX_PAGE)
    follow = serializers.BooleanField(
        required=False, default=False, help_text="a text/event-stream of the lines as they come, until the task ends"
    )


class TaskMetricsQuerySerializer(serializers.Serializer):
    window = WindowField(
        max_seconds=86_400, required=False, default=900, help_text="how far back: 90s, 10m, 2h, 1d (default 15m)"
    )


class CardReadingSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    node_id = serializers.CharField()
    utilization = serializers.FloatField(allow_null=True)
    memory_used_mb = serializers.FloatField(allow_null=True)
    power_w = serializers.FloatField(allow_null=True)
    temperature = serializers.FloatField(allow_null=True)


class CardSampleSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    gpus = CardReadingSerializer(many=True)


class TaskMetricsSerializer(serializers.Serializer):
    task = serializers.IntegerField()
    status = serializers.CharField()
    node_id = serializers.CharField(allow_null=True)
    gpu_indices = serializers.ListField(child=serializers.IntegerField(), help_text="the cards it holds now")
    window_seconds = serializers.IntegerField()
    bucket_seconds = serializers.IntegerField()
    samples = CardSampleSerializer(many=True)


class TaskGroupLogsQuerySerializer(TaskLogsQuerySerializer):
    rank = serializers.IntegerField(required=False, min_value=0, help_text="only this member's lines")
    after = serializers.CharField(
        required=False, default="", help_text="the `next` cursor of a page (rank:seq,…), or a follow's event id"
    )


class LogLineSerializer(serializers.Serializer):
    seq = serializers.IntegerField(help_text="the task's sequence number of the line, over all its runs")
    at = serializers.DateTimeField(help_text="when the agent read it")
    stream = serializers.ChoiceField(choices=logs.STREAMS)
    text = serializers.CharField()


class GroupLogLineSerializer(LogLineSerializer):
    rank = serializers.IntegerField()


class TaskLogsSerializer(serializers.Serializer):
    task_id = serializers.IntegerField()
    status = serializers.CharField()
    exit_code = serializers.IntegerField(allow_null=True)
    lines = LogLineSerializer(many=True)
    next = serializers.IntegerField(help_text="pass as `after` for the lines that follow")
    first = serializers.IntegerField(help_text="the first line kept (older ones were trimmed at the bound)")
    dropped_bytes = serializers.IntegerField(help_text="output the agent dropped over its rate limit")
    log_tail = serializers.CharField(help_text="the last lines of output, as the agent reported them at the end")


class TaskGroupLogsSerializer(serializers.Serializer):
    group_id = serializers.IntegerField()
    lines = GroupLogLineSerializer(many=True)
    next = serializers.CharField(help_text="pass as `after` for the lines that follow (rank:seq,…)")


class TaskEventCreateSerializer(AgentPayloadSerializer):
    channel = "event"

    node_id = serializers.CharField(max_length=128)
    kind = serializers.RegexField(r"^[a-z][a-z0-9_]{0,39}$", help_text="e.g. checkpoint_resume")
    message = serializers.CharField(max_length=2000)
    details = serializers.DictField(required=False, default=dict)


class ContainerLostSerializer(AgentPayloadSerializer):
    channel = "container_lost"

    node_id = serializers.CharField(max_length=128)
    detail = serializers.CharField(max_length=2000, required=False, default="", help_text="what the agent saw")


class ContainerLostVerdictSerializer(serializers.Serializer):
    task_id = serializers.IntegerField()
    verdict = serializers.ChoiceField(choices=["requeue", "fail", "undecided"])
    status = serializers.CharField(help_text="the task's status after the verdict")


class TaskEventSerializer(serializers.Serializer):
    kind = serializers.CharField()
    message = serializers.CharField()
    details = serializers.DictField()
    node = serializers.CharField(source="node_id", allow_null=True)
    created_at = serializers.DateTimeField()


# --- task groups ---------------------------------------------------------------------------


class TaskGroupCreateSerializer(ImageUnlessProcess, StrictSerializer):
    """A task group: `world_size` workers of `gpus_per_worker` cards of exactly `gpu_type`
    each, all running the same image and command (POST /api/v1/task-groups)."""

    tenant = serializers.CharField(required=False, help_text="Tenant slug; operators only, defaults to yours.")
    name = serializers.CharField(max_length=200)
    kind = serializers.ChoiceField(
        choices=GroupKind.choices,
        default=GroupKind.TRAINING,
        help_text="training (inference groups come with inference services and are refused for now)",
    )
    strategy = serializers.ChoiceField(
        choices=GroupStrategy.choices,
        default=GroupStrategy.DDP,
        help_text="how the workers split the model: tp packs them within a node, pp spreads them across nodes",
        error_messages={"invalid_choice": f'"{{input}}" is not a strategy: one of {", ".join(GroupStrategy.values)}.'},
    )
    world_size = serializers.IntegerField(
        min_value=1, help_text="workers, one task each (at most HETEROFLOW_GROUP_MAX_WORLD_SIZE, 1,024 by default)"
    )
    gpus_per_worker = serializers.IntegerField(min_value=1, max_value=MAX_GPUS_PER_TASK, default=1)
    gpu_type = serializers.ChoiceField(
        choices=GpuVendor.choices,
        help_text="every worker on this vendor's cards, never another",
        error_messages={
            "invalid_choice": '"{input}" is not a known GPU vendor: one of ' + ", ".join(GpuVendor.values) + "."
        },
    )
    runtime = serializers.ChoiceField(
        choices=TaskRuntime.choices, default=TaskRuntime.AUTO, help_text="every worker's: " + RUNTIME_HELP
    )
    image = serializers.CharField(
        max_length=500, required=False, allow_blank=True, default="", help_text="required unless runtime is process"
    )
    command = serializers.ListField(
        child=serializers.CharField(max_length=10_000), required=False, default=list, max_length=1000
    )
    env = serializers.DictField(child=EnvValueField(), required=False, default=dict)
    volumes = VolumeSerializer(many=True, required=False, default=list)
    checkpoint_path = serializers.CharField(max_length=1024, required=False, allow_blank=True, default="")
    priority = serializers.IntegerField(min_value=MIN_PRIORITY, max_value=MAX_PRIORITY, default=DEFAULT_PRIORITY)
    labels = serializers.DictField(
        child=serializers.CharField(max_length=1024, allow_blank=True), required=False, default=dict
    )
    affinity = AffinitySerializer(required=False, help_text="hard, every worker's: only nodes with these labels")
    anti_affinity = AntiAffinitySerializer(
        required=False, help_text="hard, every worker's: never nodes with these labels"
    )
    timeout_seconds = serializers.IntegerField(
        min_value=1, max_value=MAX_TASK_SECONDS, required=False, help_text="each worker's; default as for tasks"
    )
    max_duration_seconds = serializers.IntegerField(
        min_value=1,
        max_value=MAX_TASK_SECONDS,
        required=False,
        allow_null=True,
        help_text="each worker's, as a task's: how long it runs at most (at most the timeout)",
    )

    validate_env = TaskCreateSerializer.validate_env  # a task's rule for its env, word for word

    def validate(self, attrs):
        problems = image_problems(attrs) | constraints_problems(attrs, replicas=False)
        if problems:
            raise serializers.ValidationError(problems)
        return attrs

    def validate_kind(self, kind):
        if kind != GroupKind.TRAINING:
            raise serializers.ValidationError(
                f"Only training groups can be submitted for now; {kind} groups come with inference services."
            )
        return kind

    def validate_world_size(self, world_size):
        if world_size > settings.HETEROFLOW_GROUP_MAX_WORLD_SIZE:
            raise serializers.ValidationError(
                f"Ensure this value is less than or equal to {settings.HETEROFLOW_GROUP_MAX_WORLD_SIZE}."
            )
        return world_size


class TaskGroupMemberSerializer(serializers.ModelSerializer):
    """A worker of a group: its task, where it runs and how it is doing."""

    gpu_indices = serializers.SerializerMethodField(help_text="the cards it holds on its node")

    class Meta:
        model = Task
        fields = [
            "id",
            "rank",
            "name",
            "status",
            "node",
            "host_port",
            "gpu_indices",
            "exit_code",
            "error_message",
            "schedule_reason",
            "started_at",
            "finished_at",
        ]

    def get_gpu_indices(self, task) -> list[int]:
        return sorted(allocation.gpu_index for allocation in task.allocations.all())


class TaskGroupSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    status = serializers.ChoiceField(
        choices=GroupStatus.choices, read_only=True, help_text="derived from the members' statuses"
    )
    estimated_start = serializers.SerializerMethodField()

    class Meta:
        model = TaskGroup
        fields = [
            "id",
            "tenant",
            "name",
            "kind",
            "strategy",
            "placement",
            "status",
            "world_size",
            "gpus_per_worker",
            "gpu_type",
            "image",
            "command",
            "env",
            "volumes",
            "checkpoint_path",
            "priority",
            "labels",
            "runtime",
            "affinity",
            "anti_affinity",
            "network",
            "schedule_reason",
            "reservation",
            "attempts",
            "estimated_start",
            "created_by",
            "created_at",
            "updated_at",
        ]

    @extend_schema_field(ESTIMATED_START)
    def get_estimated_start(self, group) -> dict | None:
        return group.estimated_start


class TaskGroupDetailSerializer(TaskGroupSerializer):
    members = serializers.SerializerMethodField(help_text="the workers, in rank order")

    class Meta(TaskGroupSerializer.Meta):
        fields = [*TaskGroupSerializer.Meta.fields, "members"]

    @extend_schema_field(TaskGroupMemberSerializer(many=True))
    def get_members(self, group):
        return TaskGroupMemberSerializer(group.tasks.all(), many=True).data


class TaskGroupListQuerySerializer(PageQuerySerializer):
    status = serializers.ChoiceField(choices=GroupStatus.choices, required=False)


class TaskGroupEventSerializer(TaskEventSerializer):
    """A member's event, with the member it happened to."""

    task = serializers.IntegerField(source="task_id")
    rank = serializers.IntegerField(help_text="the rank of the member it happened to")
