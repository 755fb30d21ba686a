import re

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.core.pagination import PageQuerySerializer
from apps.core.serializers import StrictSerializer
from apps.inference.choices import Engine, ModelFormat, SourceKind
from apps.inference.models import Model

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
                        exc.detail[name] = [serializers.ErrorDetail(FROZEN_MESSAGE, code="frozen")]
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
