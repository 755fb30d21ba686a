from rest_framework import serializers

from apps.alerts.choices import AlertScope, AlertState, AlertType, Severity
from apps.alerts.models import Alert
from apps.core.pagination import PageQuerySerializer


class AlertSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    node = serializers.CharField(source="node_id", help_text="empty for alerts not about a node")
    task = serializers.IntegerField(source="task_id", allow_null=True)
    acknowledged_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    resolved_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = Alert
        fields = [
            "id",
            "type",
            "severity",
            "scope",
            "state",
            "key",
            "node",
            "gpu_index",
            "task",
            "tenant",
            "message",
            "details",
            "created_at",
            "updated_at",
            "acknowledged_at",
            "acknowledged_by",
            "ended_at",
            "resolved_by",
        ]


class AlertListQuerySerializer(PageQuerySerializer):
    state = serializers.ChoiceField(choices=AlertState.choices, required=False)
    type = serializers.ChoiceField(choices=AlertType.choices, required=False)
    severity = serializers.ChoiceField(choices=Severity.choices, required=False)
    scope = serializers.ChoiceField(choices=AlertScope.choices, required=False)
    node_id = serializers.CharField(max_length=128, required=False)
    task_id = serializers.IntegerField(min_value=1, required=False)
    since = serializers.DateTimeField(required=False, help_text="raised at or after (ISO 8601)")
    until = serializers.DateTimeField(required=False, help_text="raised before (ISO 8601)")
    acknowledged = serializers.BooleanField(required=False, allow_null=True, default=None)

    def validate(self, data):
        if data.get("since") and data.get("until") and data["since"] >= data["until"]:
            raise serializers.ValidationError({"until": ["Must be after since."]})
        return data


class AlertStatsSerializer(serializers.Serializer):
    active = serializers.IntegerField()
    by_state = serializers.DictField(child=serializers.IntegerField())
    active_by_severity = serializers.DictField(child=serializers.IntegerField())
    active_by_type = serializers.DictField(child=serializers.IntegerField())
    active_unacknowledged = serializers.IntegerField()
