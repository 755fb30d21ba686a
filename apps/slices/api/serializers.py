"""The slices' API shapes: the scoped read API and the agent's slice command channel
(strict bodies: an unknown field is 400, nothing written)."""

from __future__ import annotations

from rest_framework import serializers

from apps.core.pagination import PageQuerySerializer
from apps.core.serializers import StrictSerializer
from apps.slices.choices import POLL_LIMIT, QOS_OF_TIER, Qos, RequestStatus, SliceState, Tier
from apps.slices.models import Slice, SliceRequest

NODE_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class SliceSerializer(serializers.ModelSerializer):
    node_id = serializers.CharField(read_only=True)
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)
    task_id = serializers.IntegerField(read_only=True, allow_null=True)
    qos = serializers.SerializerMethodField()

    class Meta:
        model = Slice
        fields = [
            "id",
            "node_id",
            "gpu_index",
            "gpu_uuid",
            "tenant",
            "task_id",
            "tier",
            "qos",
            "memory_mb",
            "compute_percent",
            "profile",
            "state",
            "device_id",
            "handles",
            "reason",
            "error",
            "created_at",
            "updated_at",
            "confirmed_at",
            "released_at",
        ]
        read_only_fields = fields

    def get_qos(self, obj) -> str:
        return QOS_OF_TIER[obj.tier]


class SliceListQuerySerializer(PageQuerySerializer):
    node_id = serializers.RegexField(NODE_ID, required=False)
    state = serializers.ChoiceField(choices=SliceState.choices, required=False)
    tier = serializers.ChoiceField(choices=Tier.choices, required=False)
    task_id = serializers.IntegerField(min_value=1, required=False)


class SliceOnCardSerializer(serializers.Serializer):
    """A slice on a card in the node detail: another tenant's shows only carved memory."""

    id = serializers.IntegerField(allow_null=True)
    tier = serializers.ChoiceField(choices=Tier.choices)
    qos = serializers.ChoiceField(choices=Qos.choices)
    state = serializers.ChoiceField(choices=SliceState.choices)
    memory_mb = serializers.IntegerField()
    compute_percent = serializers.IntegerField(allow_null=True)
    profile = serializers.CharField()
    tenant = serializers.CharField(allow_null=True)
    task_id = serializers.IntegerField(allow_null=True)
    task_name = serializers.CharField(allow_null=True)
    own = serializers.BooleanField(help_text="The caller may see this slice (its tenant's, or an operator).")


# --- the agent's channel ---------------------------------------------------------------------


class SliceRequestSerializer(serializers.ModelSerializer):
    node_id = serializers.CharField(read_only=True)
    slice_id = serializers.IntegerField(read_only=True)

    class Meta:
        model = SliceRequest
        fields = [
            "id",
            "node_id",
            "slice_id",
            "action",
            "vendor",
            "params",
            "status",
            "result",
            "error",
            "created_at",
            "claimed_at",
            "deadline",
            "finished_at",
        ]
        read_only_fields = fields


class SliceRequestListQuerySerializer(StrictSerializer):
    node_id = serializers.RegexField(NODE_ID)
    status = serializers.ChoiceField(choices=RequestStatus.choices)
    limit = serializers.IntegerField(min_value=1, max_value=POLL_LIMIT, required=False, default=POLL_LIMIT)


class SliceRequestPageSerializer(serializers.Serializer):
    results = SliceRequestSerializer(many=True)


class InstanceSerializer(StrictSerializer):
    uuid = serializers.CharField(max_length=128, required=False, allow_blank=True, default="")
    gi = serializers.IntegerField(min_value=0, required=False)
    ci = serializers.IntegerField(min_value=0, required=False)
    profile = serializers.CharField(max_length=32, required=False, allow_blank=True)


class SliceResultSerializer(StrictSerializer):
    created = InstanceSerializer(many=True, required=False)
    destroyed = InstanceSerializer(many=True, required=False)
    device_id = serializers.CharField(max_length=128, required=False, allow_blank=True)
    handles = serializers.DictField(required=False)


CLAIM = (RequestStatus.PENDING, RequestStatus.PROCESSING)
REPORTS = {(RequestStatus.PROCESSING, RequestStatus.COMPLETED), (RequestStatus.PROCESSING, RequestStatus.FAILED)}


class SliceRequestUpdateSerializer(StrictSerializer):
    """The claim {"node_id", "from_status": "pending", "status": "processing"} or a
    report {"node_id", "from_status": "processing", "status": "completed" | "failed",
    "result": {...}, "error": "..."}."""

    node_id = serializers.RegexField(NODE_ID)
    from_status = serializers.ChoiceField(choices=[RequestStatus.PENDING, RequestStatus.PROCESSING])
    status = serializers.ChoiceField(choices=[RequestStatus.PROCESSING, RequestStatus.COMPLETED, RequestStatus.FAILED])
    result = SliceResultSerializer(required=False)
    error = serializers.CharField(max_length=10_000, required=False, allow_blank=True, default="")

    def validate(self, attrs):
        pair = (attrs["from_status"], attrs["status"])
        if pair != CLAIM and pair not in REPORTS:
            raise serializers.ValidationError(
                {"status": [f"{pair[0]} → {pair[1]} is not a claim (pending → processing) or a report."]}
            )
        if pair == CLAIM and ("result" in attrs or attrs.get("error")):
            raise serializers.ValidationError(
                {
                    name: ["A claim carries no result or error."]
                    for name in ("result", "error")
                    if name in self.initial_data
                }
            )
        return attrs
