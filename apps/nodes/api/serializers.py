import re

from rest_framework import serializers

from apps.core.pagination import PageQuerySerializer
from apps.core.serializers import StrictSerializer
from apps.nodes.choices import CordonSource, ExecMode, GpuState, GpuVendor, NodeStatus
from apps.nodes.models import Gpu, Node
from apps.nodes.presenters import GPU_COLUMNS, GPU_COMPUTED, NODE_COLUMNS, NODE_COMPUTED
from apps.slices.api.serializers import SliceOnCardSerializer


class GpuHealthSummarySerializer(serializers.Serializer):
    """A card's health in node answers (docs/gpu-health.md); the whole history is
    GET /api/v1/nodes/{id}/gpus/{index}/health."""

    at = serializers.DateTimeField(help_text="When the card's health reading last changed.")
    last_bad_at = serializers.DateTimeField(allow_null=True, help_text="The latest bad evidence.")
    ecc_corrected = serializers.IntegerField(
        allow_null=True, help_text="The larger of the volatile and aggregate counts; null: not read."
    )
    ecc_uncorrected = serializers.IntegerField(allow_null=True, help_text="As ecc_corrected.")
    pending = serializers.BooleanField(help_text="A page retirement or row remapping waits for a reset.")
    remapped_rows_failure = serializers.BooleanField()


class GpuSerializer(serializers.ModelSerializer):
    """The shape of a GPU in node answers (built by presenters.present)."""

    state = serializers.ChoiceField(choices=GpuState.choices, read_only=True)
    cordoned = serializers.BooleanField(read_only=True, help_text="No new placement on this card.")
    cordon_source = serializers.ChoiceField(choices=[("", "not cordoned"), *CordonSource.choices], read_only=True)
    health = GpuHealthSummarySerializer(
        read_only=True, allow_null=True, help_text="null: the card never reported health."
    )

    class Meta:
        model = Gpu
        fields = GPU_COLUMNS + GPU_COMPUTED


class NodeSerializer(serializers.ModelSerializer):
    """The shape of a node in API answers (built by presenters.present)."""

    tenant = serializers.CharField(
        allow_null=True, read_only=True, help_text="Slug of the owning tenant; null: shared."
    )
    gpu_used = serializers.IntegerField(read_only=True, help_text="GPUs held by active tasks.")
    gpus_lost = serializers.IntegerField(read_only=True)
    gpus = GpuSerializer(many=True, read_only=True)

    class Meta:
        model = Node
        fields = NODE_COLUMNS + NODE_COMPUTED


class GpuDetailSerializer(GpuSerializer):
    """A GPU in the node detail: with the slices carved on it (docs/slices.md)."""

    slices = SliceOnCardSerializer(
        many=True,
        read_only=True,
        help_text="The card's live slices, oldest first; another tenant's shows only tier, QoS, state and memory.",
    )

    class Meta(GpuSerializer.Meta):
        fields = GpuSerializer.Meta.fields + ["slices"]


class NodeDetailSerializer(NodeSerializer):
    gpus = GpuDetailSerializer(many=True, read_only=True)


LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")  # as in the heartbeat schema


class NodeListQuerySerializer(PageQuerySerializer):
    q = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    status = serializers.ChoiceField(choices=NodeStatus.choices, required=False, allow_blank=True, default="")
    gpu_type = serializers.ChoiceField(choices=GpuVendor.choices, required=False, allow_blank=True, default="")


class NodeUpsertSerializer(StrictSerializer):
    id = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    name = serializers.CharField(max_length=200, required=False)
    ip = serializers.IPAddressField(required=False, allow_null=True)
    internal_ip = serializers.IPAddressField(required=False, allow_null=True)
    mac = serializers.RegexField(r"^([0-9A-Fa-f]{2}[:-]){5}[0-9A-Fa-f]{2}$", required=False, allow_blank=True)
    hostname = serializers.CharField(max_length=255, required=False, allow_blank=True)
    cpu_cores = serializers.IntegerField(min_value=1, max_value=4096, required=False, allow_null=True)
    memory_gb = serializers.FloatField(min_value=0, required=False, allow_null=True)
    exec_mode = serializers.ChoiceField(choices=ExecMode.choices, required=False)
    labels = serializers.DictField(child=serializers.CharField(max_length=1024, allow_blank=True), required=False)

    def validate_mac(self, value):
        return value.lower().replace("-", ":")

    def validate_labels(self, value):
        if len(value) > 64:
            raise serializers.ValidationError("At most 64 labels.")
        bad = [key for key in value if not LABEL_KEY.match(key)]
        if bad:
            raise serializers.ValidationError(f"Invalid label keys: {', '.join(sorted(bad))}.")
        return value


class LocationSerializer(StrictSerializer):
    region = serializers.CharField(max_length=64, required=False, allow_blank=True)
    zone = serializers.CharField(max_length=64, required=False, allow_blank=True)
    rack = serializers.CharField(max_length=64, required=False, allow_blank=True)


class ServiceMoveSerializer(StrictSerializer):
    """The body of drain, maintenance and return: nothing, or the operator's reason."""

    reason = serializers.CharField(
        max_length=500, required=False, allow_blank=True, default="", help_text="Kept in the audit record."
    )


class TenantAssignmentSerializer(StrictSerializer):
    tenant = serializers.CharField(allow_null=True, help_text="Tenant slug, or null for a shared node.")
    version = serializers.IntegerField(min_value=1, help_text="The node's version as you read it.")
    mode = serializers.ChoiceField(choices=[("drain", "drain"), ("evict", "evict")], default="drain")


class HoursSerializer(StrictSerializer):
    hours = serializers.IntegerField(min_value=1, max_value=168, default=1)
