import re

from rest_framework import serializers

from apps.core.pagination import PageQuerySerializer
from apps.core.serializers import StrictSerializer
from apps.nodes.choices import CardIdentity, CordonSource, ExecMode, GpuState, GpuVendor, NodeStatus
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
    matched_by = serializers.ChoiceField(
        choices=CardIdentity.choices,
        read_only=True,
        help_text="How the heartbeat tells this card from its neighbours; position: when it is lost, "
        "which card failed cannot be told.",
    )
    reported_index = serializers.IntegerField(
        read_only=True,
        allow_null=True,
        help_text="The index the agent reports the card under now: not index after the vendor's tool "
        "renumbered its cards; null: not in the agent's list.",
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
    gpus_lost_unidentified = serializers.IntegerField(
        read_only=True,
        help_text="Lost GPUs known only by their position: which cards failed cannot be told (docs/nodes.md).",
    )
    gpu_loss_note = serializers.CharField(
        read_only=True, help_text="Says so when gpus_lost_unidentified is not 0; empty otherwise."
    )
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


# --- energy and carbon (docs/energy.md) -------------------------------------------------------

MAX_TDP_W = 2000.0  # all sockets of one node; more is a typo


class NumberField(serializers.FloatField):
    """A finite number (DRF refuses NaN and infinities), not a boolean."""

    def to_internal_value(self, data):
        if isinstance(data, bool):
            self.fail("invalid")
        return super().to_internal_value(data)


class EnergyQuerySerializer(HoursSerializer):
    days = serializers.IntegerField(
        min_value=1, max_value=366, default=30, help_text="How many UTC days of daily energy (energy_daily)."
    )


class NodeEnergySettingsSerializer(StrictSerializer):
    """PUT /api/v1/admin/nodes/{id}/energy: omitted = unchanged, null = cleared."""

    emission_factor_g_per_kwh = NumberField(
        min_value=0,
        max_value=2000,
        allow_null=True,
        required=False,
        help_text="The node's own factor (g CO2e/kWh), over its region's; null: use the region's.",
    )
    cpu_tdp_w = NumberField(
        min_value=1,
        max_value=MAX_TDP_W,
        allow_null=True,
        required=False,
        help_text="The node's CPU TDP (W, all sockets) for the CPU estimate; null: the CPU model table's.",
    )


class EmissionFactorWriteSerializer(StrictSerializer):
    g_co2e_per_kwh = NumberField(min_value=0, max_value=2000, help_text="Grid carbon intensity, g CO2e per kWh.")
    source = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class EmissionFactorSerializer(serializers.Serializer):
    region = serializers.CharField()
    g_co2e_per_kwh = serializers.FloatField()
    source = serializers.CharField()
    updated_at = serializers.DateTimeField()
    nodes = serializers.IntegerField(help_text="Nodes in the region without a factor of their own.")


class NodeEnergySettingsAnswerSerializer(serializers.Serializer):
    node_id = serializers.CharField()
    emission_factor_g_per_kwh = serializers.FloatField(allow_null=True)
    cpu_tdp_w = serializers.FloatField(allow_null=True)
    cpu_tdp_w_model = serializers.FloatField(allow_null=True)
    region = serializers.CharField()
    factor_g_per_kwh = serializers.FloatField(allow_null=True, help_text="The factor that covers the node now.")
    factor_source = serializers.CharField(allow_null=True, help_text="node, region, or null: none.")


class CardEnergySerializer(serializers.Serializer):
    index = serializers.IntegerField()
    energy_kwh = serializers.FloatField(allow_null=True, help_text="Measured, lifetime; null: never measured.")
    since = serializers.DateTimeField(allow_null=True)
    gap_seconds = serializers.FloatField(allow_null=True, help_text="Time between readings too far apart to count.")
    power_w = serializers.FloatField(allow_null=True)
    power_at = serializers.DateTimeField(allow_null=True)
    lost = serializers.BooleanField()


class CpuEstimateSerializer(serializers.Serializer):
    estimate = serializers.BooleanField(help_text="Always true: estimated from utilisation and TDP, never measured.")
    energy_kwh = serializers.FloatField(allow_null=True)
    power_w = serializers.FloatField(allow_null=True)
    at = serializers.DateTimeField(allow_null=True)
    tdp_w = serializers.FloatField(allow_null=True)
    tdp_source = serializers.CharField(allow_null=True, help_text="operator, model, or null: no TDP known.")


class LifetimeEnergySerializer(serializers.Serializer):
    gpu_energy_kwh = serializers.FloatField(allow_null=True)
    since = serializers.DateTimeField(allow_null=True)
    gap_seconds = serializers.FloatField(allow_null=True)
    gpus = CardEnergySerializer(many=True)
    cpu_estimate = CpuEstimateSerializer()


class CardPowerSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    power_w = serializers.FloatField(allow_null=True)


class PowerPointSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    gpus = CardPowerSerializer(many=True, help_text="Measured, per card that reported in the bucket.")
    gpu_power_w = serializers.FloatField(allow_null=True, help_text="Measured, the node's cards together.")
    cpu_power_w_estimate = serializers.FloatField(allow_null=True, help_text="Estimated.")


class PowerSeriesSerializer(serializers.Serializer):
    bucket_seconds = serializers.IntegerField()
    cpu_estimate = serializers.BooleanField()
    points = PowerPointSerializer(many=True)


class DailyCardSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    kwh = serializers.FloatField()


class DailyEnergySerializer(serializers.Serializer):
    day = serializers.DateField()
    gpu_kwh = serializers.FloatField(allow_null=True)
    cpu_kwh_estimate = serializers.FloatField(allow_null=True)
    gpus = DailyCardSerializer(many=True)


BASIS_HELP = (
    "factor: figures given; no_factor: no emission factor covers the node (no absolute figure); no_data: "
    "nothing measured; not_visible: the viewer's role does not see node carbon (docs/energy.md#carbon)."
)


class NodeCarbonSerializer(serializers.Serializer):
    basis = serializers.CharField(help_text=BASIS_HELP)
    factor_g_per_kwh = serializers.FloatField(allow_null=True)
    factor_source = serializers.CharField(allow_null=True)
    lifetime_gpu_g = serializers.FloatField(allow_null=True)
    window_gpu_g = serializers.FloatField(allow_null=True)
    lifetime_cpu_estimate_g = serializers.FloatField(allow_null=True)
    window_cpu_estimate_g = serializers.FloatField(allow_null=True)
    configure = serializers.CharField(required=False, help_text="Operators, no factor: how to configure one.")


class NodeEnergySerializer(serializers.Serializer):
    node_id = serializers.CharField()
    hours = serializers.IntegerField()
    days = serializers.IntegerField()
    gpu_energy_kwh = serializers.FloatField(allow_null=True, help_text="The window's, from measured power.")
    gpu_power_avg_w = serializers.FloatField(allow_null=True)
    gpu_power_max_w = serializers.FloatField(allow_null=True)
    samples_with_power = serializers.IntegerField()
    cpu_energy_kwh_estimate = serializers.FloatField(allow_null=True, help_text="The window's, estimated.")
    lifetime = LifetimeEnergySerializer()
    series = PowerSeriesSerializer()
    daily = DailyEnergySerializer(many=True)
    carbon = NodeCarbonSerializer()
