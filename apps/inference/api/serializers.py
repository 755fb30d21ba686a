import re

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.core.pagination import PageQuerySerializer
from apps.core.serializers import AgentPayloadSerializer, StrictSerializer
from apps.inference import model_ensure
from apps.inference.autoscale import PolicyError, parse_policy
from apps.inference.choices import Engine, ModelFormat, ServiceStatus, SourceKind
from apps.inference.error_codes import InferenceErrorCode
from apps.inference.models import InferenceService, Model, ServiceDecision
from apps.inference.selectors import loans_of_service
from apps.inference.sleep import SleepPolicy, validate_sleep_policy
from apps.inference.windows import WindowError, inside, next_boundary, parse_window, validate_window
from apps.nodes.choices import GpuVendor
from apps.tasks.api.serializers import (
    RUNTIME_HELP,
    AffinitySerializer,
    AntiAffinitySerializer,
    EnvValueField,
    TaskCreateSerializer,
    constraints_problems,
)
from apps.tasks.choices import DEFAULT_PRIORITY, MAX_GPUS_PER_TASK, MAX_PRIORITY, MIN_PRIORITY, TaskRuntime
from apps.tenants import policy

# What clients put in "model": letters, digits and . _ - : / (hub-style "org/name",
# ollama-style "name:tag"), starting with a letter or digit.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
# an image reference: [registry[:port]/]repository[:tag][@sha256:digest], no spaces
IMAGE_REF = re.compile(
    r"^[a-z0-9][a-z0-9._-]*(:[0-9]+)?(/[a-z0-9][a-z0-9._-]*)*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?(@sha256:[a-f0-9]{64})?$"
)
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_NODES = 256


def unique_items(items: list, what: str) -> list:
    repeated = sorted({item for item in items if items.count(item) > 1})
    if repeated:
        raise serializers.ValidationError([f"{what} '{item}' is listed twice." for item in repeated])
    return items


class EnginesField(serializers.ListField):
    child = serializers.ChoiceField(choices=Engine.choices)

    def __init__(self, **kwargs):
        kwargs.setdefault("max_length", len(Engine.values))
        kwargs.setdefault(
            "help_text", "The engines that can serve it, each once; empty: the engine router chooses by format."
        )
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        return unique_items(super().to_internal_value(data), "Engine")


class NodesField(serializers.ListField):
    child = serializers.CharField(max_length=128)

    def __init__(self, **kwargs):
        kwargs.setdefault("max_length", MAX_NODES)
        kwargs.setdefault(
            "help_text",
            "Ids of the nodes it is registered on (shared nodes or the tenant's own), each once; empty: not pinned.",
        )
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        return unique_items(super().to_internal_value(data), "Node")


class ModelCreateSerializer(StrictSerializer):
    tenant = serializers.CharField(required=False, help_text="Tenant slug; operators only, defaults to yours.")
    name = serializers.CharField(max_length=200, help_text='What clients put in "model"; unique in the tenant.')
    source_kind = serializers.ChoiceField(choices=SourceKind.choices)
    source = serializers.CharField(
        max_length=1024,
        help_text="path: an absolute path on the nodes' model cache; image: a registry image reference; "
        "hub: a hub id (org/name).",
    )
    format = serializers.ChoiceField(choices=ModelFormat.choices)
    size_bytes = serializers.IntegerField(min_value=0, required=False, allow_null=True, default=None)
    engines = EnginesField(required=False, default=list)
    nodes = NodesField(required=False, default=list)

    def validate_name(self, name):
        if not MODEL_NAME.match(name):
            raise serializers.ValidationError(
                "Letters, digits and . _ - : / only, starting with a letter or digit (at most 200)."
            )
        return name

    def validate(self, attrs):
        kind, source = attrs["source_kind"], attrs["source"]
        problem = None
        if kind == SourceKind.PATH:
            if not source.startswith("/") or "\x00" in source:
                problem = "A path source is an absolute path on the nodes (starting with /)."
            elif ".." in source.split("/"):
                problem = "A path source cannot contain '..'."
        elif kind == SourceKind.IMAGE and not IMAGE_REF.match(source):
            problem = "Not an image reference (registry/repository:tag or @sha256:digest, lower case, no spaces)."
        elif kind == SourceKind.HUB and not HUB_ID.match(source):
            problem = "A hub id is 'org/name' (letters, digits, . _ -)."
        if problem:
            raise serializers.ValidationError({"source": [problem]})
        return attrs


FROZEN = ("tenant", "name", "source_kind", "source", "format")
FROZEN_MESSAGE = "Cannot be changed; register a new model instead."


class ModelUpdateSerializer(StrictSerializer):
    """PATCH: size, engines and nodes; a field left out is unchanged. The name, source and
    format are refused by name (register a new model instead)."""

    size_bytes = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    engines = EnginesField(required=False)
    nodes = NodesField(required=False)

    def to_internal_value(self, data):
        """The strict check refuses the frozen fields as unknown; say why instead."""
        try:
            return super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if isinstance(exc.detail, dict):
                for name in FROZEN:
                    if name in exc.detail:
                        exc.detail[name] = [serializers.ErrorDetail(FROZEN_MESSAGE, code=InferenceErrorCode.FROZEN)]
            raise

    def validate(self, attrs):
        if not attrs:
            raise serializers.ValidationError("Nothing to change: send size_bytes, engines or nodes.")
        return attrs


class CachedOnSerializer(serializers.Serializer):
    node_id = serializers.CharField()
    node_name = serializers.CharField()
    status = serializers.CharField(help_text="the node's status now")
    paths = serializers.ListField(
        child=serializers.CharField(), help_text="where the node's scan found it (discovered_models)"
    )
    labelled = serializers.BooleanField(help_text="the node's heteroflow.cache/models label lists it")
    served_by_tasks = serializers.ListField(
        child=serializers.IntegerField(),
        help_text="the inference tasks on the node whose engine has it loaded (their /v1/models, read by the agent)",
    )


class ModelSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    nodes = serializers.SerializerMethodField()
    engines = serializers.ListField(child=serializers.ChoiceField(choices=Engine.choices))
    cached_on = serializers.SerializerMethodField()

    class Meta:
        model = Model
        fields = [
            "id",
            "tenant",
            "name",
            "source_kind",
            "source",
            "format",
            "size_bytes",
            "engines",
            "nodes",
            "cached_on",
            "created_at",
            "updated_at",
        ]

    def get_nodes(self, model) -> list[str]:
        return sorted(node.pk for node in model.nodes.all())

    @extend_schema_field(CachedOnSerializer(many=True))
    def get_cached_on(self, model) -> list[dict]:
        """From the context's `cached_on` (selectors.cached_on for the page), by model id."""
        return self.context.get("cached_on", {}).get(model.pk, [])


class ModelListQuerySerializer(PageQuerySerializer):
    # not `format`: DRF reads ?format= as the renderer to answer with
    model_format = serializers.ChoiceField(choices=ModelFormat.choices, required=False, help_text="the model's format")
    engine = serializers.ChoiceField(choices=Engine.choices, required=False)


# --- inference services ------------------------------------------------------------------

ENGINE_CHOICES = [("auto", "auto: the agent's engine router chooses"), *Engine.choices]
MAX_SLEEP_AFTER_SECONDS = 31 * 86_400
DECISIONS_SHOWN = 20  # the latest decisions a service's detail carries; the rest: …/decisions
# the two bounds are the service's own fields; inside `autoscaling` they would be a second
# place to say the same thing
TOP_LEVEL_BOUNDS = ("min_replicas", "max_replicas")
TENANT_REQUIRED = "Required: the slug of the tenant the service runs for."


class ServiceHealthProbeSerializer(StrictSerializer):
    """As a task's probe, with the defaults an inference engine answers to: an HTTP GET of
    /v1/models on the replica's port."""

    type = serializers.ChoiceField(choices=[("http", "http"), ("tcp", "tcp")], default="http")
    port = serializers.IntegerField(
        min_value=1, max_value=65535, required=False, help_text="default: the replica's host port"
    )
    path = serializers.CharField(max_length=500, required=False, default="/v1/models")

    def validate_path(self, path):
        if not path.startswith("/"):
            raise serializers.ValidationError("A path starts with /.")
        return path


def problems(errors: list[str], *, renamed: dict[str, str] | None = None) -> list[str]:
    """A pure module's error list as the API's messages: sentences, with the module's
    field names written as the body's."""
    out = []
    for error in errors:
        for old, new in (renamed or {}).items():
            error = error.replace(old, new)
        out.append(error[:1].upper() + error[1:] + ("" if error.endswith(".") else "."))
    return out


class ServiceCreateSerializer(StrictSerializer):
    """The body of POST /api/v1/inference-services (docs/api.md#inference-services). With
    the request's principal in the context (`principal`), `model` is checked to be a model
    of the tenant the request acts for; without it (the schema), only its shape."""

    tenant = serializers.CharField(required=False, help_text="Tenant slug; operators only, defaults to yours.")
    name = serializers.CharField(max_length=200, help_text="Replica r's task is named <name>-<r>.")
    model = serializers.CharField(max_length=200, help_text="The name of one of the tenant's models (/api/v1/models).")
    engine = serializers.ChoiceField(
        choices=ENGINE_CHOICES,
        default="auto",
        help_text="\"auto\" (the agent's engine router chooses from the node and the model's format) or an engine",
        error_messages={
            "invalid_choice": '"{input}" is not an engine: auto or one of ' + ", ".join(Engine.values) + "."
        },
    )
    gpu_type = serializers.ChoiceField(
        choices=GpuVendor.choices,
        help_text="every replica on this vendor's cards, never another",
        error_messages={
            "invalid_choice": '"{input}" is not a known GPU vendor: one of ' + ", ".join(GpuVendor.values) + "."
        },
    )
    gpus_per_replica = serializers.IntegerField(
        min_value=0,
        max_value=MAX_GPUS_PER_TASK,
        default=1,
        help_text="whole cards per replica; 0: each replica takes gpu_memory_mb of one card (a memory-only "
        "task's slice, docs/inference.md#memory-share-replicas)",
    )
    gpu_memory_mb = serializers.IntegerField(
        min_value=1,
        required=False,
        allow_null=True,
        default=None,
        help_text="GPU memory per replica; required with gpus_per_replica 0",
    )
    memory_request_mb = serializers.IntegerField(
        min_value=0, required=False, allow_null=True, default=None, help_text="host memory per replica"
    )
    min_replicas = serializers.IntegerField(
        min_value=1, default=1, help_text="at least 1: an idle service goes to zero by sleeping"
    )
    max_replicas = serializers.IntegerField(
        min_value=1, required=False, help_text="default: min_replicas (no autoscaling)"
    )
    engine_args = serializers.ListField(
        child=serializers.CharField(max_length=10_000), required=False, default=list, max_length=1000
    )
    health_probe = ServiceHealthProbeSerializer(
        required=False, allow_null=True, default=None, help_text='default: {"type": "http", "path": "/v1/models"}'
    )
    autoscaling = serializers.DictField(
        required=False,
        default=dict,
        help_text="the autoscaling policy (docs/inference.md#autoscaling): target_in_flight (default 8), "
        "target_tokens_per_s, target_gpu_utilisation, max_in_flight_per_replica, cooldowns, stabilisations, "
        "max_sample_age_s; the bounds are min_replicas and max_replicas",
    )
    window = serializers.DictField(
        required=False,
        allow_null=True,
        default=None,
        help_text="a scheduling window (docs/inference.md#scheduling-windows): days, ranges, timezone, action, "
        "scale_to; null: always",
    )
    sleep_after_seconds = serializers.IntegerField(
        min_value=0,
        max_value=MAX_SLEEP_AFTER_SECONDS,
        required=False,
        allow_null=True,
        default=None,
        help_text="idle this long: the service sleeps (at least 60); null: never",
    )
    lendable = serializers.BooleanField(
        default=True,
        help_text="idle replicas' cards may be lent to a training task of its tenant or tenant group "
        "(docs/inference.md#training-borrows-idle-cards); false: never",
    )
    image = serializers.CharField(
        max_length=500, required=False, allow_blank=True, default="auto", help_text='"auto": the router chooses'
    )
    env = serializers.DictField(child=EnvValueField(), required=False, default=dict)
    priority = serializers.IntegerField(min_value=MIN_PRIORITY, max_value=MAX_PRIORITY, default=DEFAULT_PRIORITY)
    labels = serializers.DictField(
        child=serializers.CharField(max_length=1024, allow_blank=True), required=False, default=dict
    )
    runtime = serializers.ChoiceField(
        choices=TaskRuntime.choices, default=TaskRuntime.AUTO, help_text="every replica's: " + RUNTIME_HELP
    )
    affinity = AffinitySerializer(required=False, help_text="hard, every replica's: only nodes with these labels")
    anti_affinity = AntiAffinitySerializer(
        required=False,
        help_text="hard, every replica's: never nodes with these labels; same_service: no two replicas on one node",
    )

    validate_env = TaskCreateSerializer.validate_env  # a task's rule for its env, word for word

    def validate_model(self, name):
        if not MODEL_NAME.match(name):
            raise serializers.ValidationError("Not a model name (letters, digits and . _ - : /).")
        return name

    def validate_image(self, image):
        return image.strip() or "auto"

    def validate_sleep_after_seconds(self, seconds):
        errors = validate_sleep_policy(SleepPolicy(sleep_after_s=seconds))
        if errors:
            raise serializers.ValidationError(problems(errors, renamed={"sleep_after_s": "sleep_after_seconds"}))
        return seconds

    def validate_min_replicas(self, count):
        return self._at_most_the_largest_group(count)

    def validate_max_replicas(self, count):
        return self._at_most_the_largest_group(count)

    def _at_most_the_largest_group(self, count):
        if count > settings.HETEROFLOW_GROUP_MAX_WORLD_SIZE:
            raise serializers.ValidationError(
                f"Ensure this value is less than or equal to {settings.HETEROFLOW_GROUP_MAX_WORLD_SIZE}."
            )
        return count

    def validate_window(self, window):
        if window is None:
            return None
        errors = validate_window(window)
        if errors:
            raise serializers.ValidationError(problems(errors))
        return window

    def validate(self, attrs):
        attrs.setdefault("max_replicas", attrs["min_replicas"])
        low, high = attrs["min_replicas"], attrs["max_replicas"]
        errors: dict[str, list[str]] = {}
        if high < low:
            errors["max_replicas"] = [f"max_replicas ({high}) is below min_replicas ({low})."]
        autoscaling = attrs["autoscaling"]
        inside = [name for name in TOP_LEVEL_BOUNDS if name in autoscaling]
        if inside:
            errors["autoscaling"] = [
                f"{name} is a field of the service, not of its autoscaling policy." for name in inside
            ]
        elif high >= low:
            try:
                parse_policy({**autoscaling, "min_replicas": low, "max_replicas": high})
            except PolicyError as error:
                errors["autoscaling"] = problems(error.errors)
        window = attrs["window"]
        if window and window.get("action") == "scale" and high >= low and window["scale_to"] > high:
            errors["window"] = [f"scale_to ({window['scale_to']}) is above max_replicas ({high})."]
        errors |= constraints_problems(attrs, replicas=True)
        if errors:
            raise serializers.ValidationError(errors)
        model = self.tenant_model(attrs)
        if model is not None and attrs["engine"] != "auto" and model.engines and attrs["engine"] not in model.engines:
            raise serializers.ValidationError(
                {
                    "engine": [
                        f"Model '{model.name}' lists the engines {', '.join(model.engines)}, not {attrs['engine']}; "
                        'pick one of them or "auto".'
                    ]
                }
            )
        return attrs

    def tenant_model(self, attrs) -> Model | None:
        """The model `attrs` names, in the tenant the request acts for (the principal's,
        or the operator's `tenant`); 400 on `model` when that tenant has none of that
        name; 400 on `tenant` for an operator who names none, 404 for a tenant not the
        caller's (as every create). None without a principal in the context."""
        principal = self.context.get("principal")
        if principal is None:
            return None
        tenant = policy.acting_tenant(principal, attrs.get("tenant"), required=TENANT_REQUIRED)
        model = Model.objects.filter(tenant=tenant, name=attrs["model"]).first()
        if model is None:
            raise serializers.ValidationError(
                {"model": [f"Tenant '{tenant.slug}' has no model named '{attrs['model']}' (register it first)."]}
            )
        return model


class ServiceScaleSerializer(StrictSerializer):
    replicas = serializers.IntegerField(min_value=0, help_text="between the service's min_replicas and max_replicas")


class ModelFetchSerializer(serializers.Serializer):
    """A replica's model download as its node last reported it (apps.inference.model_ensure)."""

    model = serializers.CharField()
    node_id = serializers.CharField()
    bytes_done = serializers.IntegerField()
    bytes_total = serializers.IntegerField(allow_null=True)
    bytes_per_second = serializers.FloatField()
    eta_seconds = serializers.FloatField(allow_null=True, help_text="at the last speed; null: not known yet")


class ReplicaSerializer(serializers.Serializer):
    """One replica (apps.inference.selectors.replicas_of's row): its task, where it runs
    and whether it answers, and its model's download while its node fetches it."""

    task_id = serializers.IntegerField()
    rank = serializers.IntegerField(help_text="the replica slot")
    status = serializers.CharField(help_text="its task's status")
    node_id = serializers.CharField(allow_null=True)
    node_address = serializers.CharField(allow_null=True, help_text="the node's reported IP")
    host_port = serializers.IntegerField(allow_null=True)
    healthy = serializers.BooleanField(
        allow_null=True, help_text="its node's latest probe of it; null: not running, or not probed yet"
    )
    address = serializers.CharField(allow_null=True, help_text="http://ip:port, what the gateway sends requests to")
    started_at = serializers.DateTimeField(allow_null=True)
    model_fetch = ModelFetchSerializer(
        allow_null=True, default=None, help_text="its node downloading its model now; null: not downloading"
    )


class DecisionSerializer(serializers.ModelSerializer):
    class Meta:
        model = ServiceDecision
        fields = ["id", "source", "action", "from_replicas", "to_replicas", "reason", "details", "created_at"]


class WindowStatusSerializer(serializers.Serializer):
    inside = serializers.BooleanField(help_text="now is inside the window")
    next_boundary = serializers.DateTimeField(allow_null=True, help_text="when that changes; null: never")
    holds = serializers.BooleanField(help_text="the window's action holds the service (the AutoScaler skips it)")
    action = serializers.CharField(help_text="the action it holds with; empty when it does not hold")
    remembered = serializers.IntegerField(allow_null=True, help_text="the count a pause or scale restores")


def window_status(service, now) -> dict | None:
    """Where `now` is against the service's window, and whether its action holds the
    service; None without a window."""
    if not service.window:
        return None
    try:
        window = parse_window(service.window)
    except WindowError:  # stored before a rule tightened: shown as not understood, not a 500
        return None
    return {
        "inside": inside(window, now),
        "next_boundary": next_boundary(window, now),
        "holds": bool(service.window_action),
        "action": service.window_action,
        "remembered": service.window_remembered,
    }


class ServiceSerializer(serializers.ModelSerializer):
    id = serializers.IntegerField(source="group_id", read_only=True, help_text="the service's id (its group's)")
    tenant = serializers.CharField(source="group.tenant.slug", read_only=True)
    name = serializers.CharField(source="group.name", read_only=True)
    model = serializers.CharField(source="model.name", read_only=True)
    gpu_type = serializers.CharField(source="group.gpu_type", read_only=True)
    gpus_per_replica = serializers.SerializerMethodField(help_text="0: the replicas share cards by gpu_memory_mb")
    image = serializers.CharField(source="group.image", read_only=True)
    env = serializers.JSONField(source="group.env", read_only=True)
    priority = serializers.IntegerField(source="group.priority", read_only=True)
    labels = serializers.JSONField(source="group.labels", read_only=True)
    runtime = serializers.CharField(source="group.runtime", read_only=True)
    affinity = serializers.JSONField(source="group.affinity", read_only=True)
    anti_affinity = serializers.JSONField(source="group.anti_affinity", read_only=True)
    created_by = serializers.CharField(source="group.created_by.username", read_only=True, allow_null=True)

    def get_gpus_per_replica(self, service) -> int:
        return 0 if service.memory_share else service.group.gpus_per_worker

    class Meta:
        model = InferenceService
        fields = [
            "id",
            "tenant",
            "name",
            "model",
            "model_id",
            "engine",
            "gpu_type",
            "gpus_per_replica",
            "gpu_memory_mb",
            "memory_request_mb",
            "image",
            "engine_args",
            "health_probe",
            "env",
            "priority",
            "labels",
            "runtime",
            "affinity",
            "anti_affinity",
            "min_replicas",
            "max_replicas",
            "replicas",
            "autoscaling",
            "window",
            "sleep_after_seconds",
            "lendable",
            "state",
            "state_changed_at",
            "last_scaled_at",
            "last_scale_direction",
            "last_request_at",
            "created_by",
            "created_at",
            "updated_at",
        ]


class ServiceDetailSerializer(ServiceSerializer):
    """A service with its replicas (context `members`: replicas_of's rows), the window's
    status (context `now`) and its latest decisions."""

    members = serializers.SerializerMethodField(help_text="the replicas, in rank order")
    healthy_replicas = serializers.SerializerMethodField()
    window_status = serializers.SerializerMethodField()
    decisions = serializers.SerializerMethodField(
        help_text=f"the latest {DECISIONS_SHOWN}, newest first; all: GET …/{{id}}/decisions"
    )

    loans = serializers.SerializerMethodField(
        help_text="its latest loans of idle cards to training, open ones first (docs/inference.md"
        "#training-borrows-idle-cards): loan_id, service_id, name, borrower_id, borrower, node_id, replicas, "
        "sleeps, state (open | returned), since, returned_at, returned_why"
    )

    class Meta(ServiceSerializer.Meta):
        fields = [*ServiceSerializer.Meta.fields, "healthy_replicas", "members", "window_status", "decisions", "loans"]

    @extend_schema_field(ReplicaSerializer(many=True))
    def get_members(self, service):
        return ReplicaSerializer(self.context["members"], many=True).data

    def get_healthy_replicas(self, service) -> int:
        return sum(1 for row in self.context["members"] if row["healthy"])

    @extend_schema_field(WindowStatusSerializer(allow_null=True))
    def get_window_status(self, service):
        status = window_status(service, self.context["now"])
        return None if status is None else WindowStatusSerializer(status).data

    @extend_schema_field(DecisionSerializer(many=True))
    def get_decisions(self, service):
        return DecisionSerializer(service.decisions.all()[:DECISIONS_SHOWN], many=True).data

    def get_loans(self, service) -> list[dict]:
        return loans_of_service(service)


class ServiceListQuerySerializer(PageQuerySerializer):
    state = serializers.ChoiceField(choices=ServiceStatus.choices, required=False)
    model = serializers.CharField(max_length=200, required=False, help_text="a model's name")


class DecisionListQuerySerializer(PageQuerySerializer):
    source = serializers.ChoiceField(
        choices=[(s, s) for s in ("autoscaler", "window", "sleep", "wake", "rebuild", "user", "ensure", "lending")],
        required=False,
    )


class ModelEnsureReportSerializer(AgentPayloadSerializer):
    """What the agent reports while it makes a replica's model present
    (apps.inference.model_ensure)."""

    channel = "model_ensure"

    node_id = serializers.CharField(max_length=128)
    state = serializers.ChoiceField(choices=model_ensure.STATES)
    model = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    bytes_done = serializers.IntegerField(min_value=0, required=False, default=0)
    bytes_total = serializers.IntegerField(min_value=0, required=False, allow_null=True, default=None)
    bytes_per_second = serializers.FloatField(min_value=0, required=False, default=0.0)
    eta_seconds = serializers.FloatField(min_value=0, required=False, allow_null=True, default=None)
    seconds = serializers.FloatField(min_value=0, required=False, allow_null=True, default=None)
    message = serializers.CharField(max_length=2000, required=False, allow_blank=True, default="")

    def validate(self, attrs):
        if attrs["state"] == model_ensure.FAILED and not attrs["message"].strip():
            raise serializers.ValidationError({"message": ["A failure says why."]})
        return attrs
