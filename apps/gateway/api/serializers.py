from rest_framework import serializers

from apps.core.clock import utcnow
from apps.core.pagination import PageQuerySerializer
from apps.core.serializers import StrictSerializer
from apps.gateway.models import EndpointKey, ExternalBackend, UsageBucket


class EndpointKeySerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    created_by = serializers.CharField(source="created_by.username", read_only=True, default=None)
    active = serializers.SerializerMethodField()

    class Meta:
        model = EndpointKey
        fields = [
            "id",
            "tenant",
            "name",
            "display_prefix",
            "previous_display_prefix",
            "previous_valid_until",
            "allowed_models",
            "rpm_limit",
            "tpm_limit",
            "concurrency_limit",
            "created_by",
            "created_at",
            "rotated_at",
            "expires_at",
            "last_used_at",
            "revoked_at",
            "active",
        ]

    def get_active(self, obj) -> bool:
        return obj.is_usable_at(utcnow())


class EndpointKeyCreatedSerializer(EndpointKeySerializer):
    key = serializers.CharField(help_text="The key itself (sk-hf-…). Shown once; store it now.")

    class Meta(EndpointKeySerializer.Meta):
        fields = EndpointKeySerializer.Meta.fields + ["key"]


def _future(value):
    if value is not None and value <= utcnow():
        raise serializers.ValidationError("Must be in the future.")
    return value


class _KeyFields(StrictSerializer):
    name = serializers.CharField(max_length=100)
    allowed_models = serializers.ListField(
        child=serializers.CharField(max_length=200),
        required=False,
        max_length=1000,
        help_text="Model names this key may call; empty or absent: every model of the tenant.",
    )
    rpm_limit = serializers.IntegerField(min_value=1, max_value=10_000_000, required=False, allow_null=True)
    tpm_limit = serializers.IntegerField(min_value=1, max_value=10_000_000_000, required=False, allow_null=True)
    concurrency_limit = serializers.IntegerField(min_value=1, max_value=100_000, required=False, allow_null=True)
    expires_at = serializers.DateTimeField(required=False, allow_null=True)

    def validate_expires_at(self, value):
        return _future(value)


class EndpointKeyCreateSerializer(_KeyFields):
    tenant = serializers.CharField(required=False, help_text="Tenant slug; defaults to the caller's tenant.")


class EndpointKeyUpdateSerializer(_KeyFields):
    name = serializers.CharField(max_length=100, required=False)


class EndpointKeyRotateSerializer(StrictSerializer):
    grace_seconds = serializers.IntegerField(
        min_value=0,
        max_value=30 * 86_400,
        required=False,
        help_text="How long the current secret keeps working; default HETEROFLOW_GATEWAY_ROTATE_GRACE_SECONDS.",
    )


class UsageQuerySerializer(PageQuerySerializer):
    key = serializers.IntegerField(required=False, min_value=1, help_text="an endpoint key's id")
    model = serializers.CharField(required=False, max_length=200)
    service = serializers.IntegerField(required=False, min_value=1, help_text="an inference service's id")
    since = serializers.DateTimeField(required=False, help_text="from this minute on (inclusive)")
    until = serializers.DateTimeField(required=False, help_text="before this minute")


class UsageBucketSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    service = serializers.IntegerField(source="service_id", read_only=True)

    class Meta:
        model = UsageBucket
        fields = [
            "minute",
            "tenant",
            "key",
            "model",
            "service",
            "requests",
            "errors",
            "prompt_tokens",
            "completion_tokens",
            "gpu_seconds",
        ]


class UsageTotalSerializer(serializers.Serializer):
    tenant = serializers.CharField(source="tenant__slug")
    key = serializers.IntegerField(source="key_id", allow_null=True)
    key_name = serializers.CharField(source="key__name", allow_null=True)
    model = serializers.CharField()
    requests = serializers.IntegerField()
    errors = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    gpu_seconds = serializers.FloatField(help_text="the requests' shares of their replicas' cards")
    minutes = serializers.IntegerField()


class ExternalBackendSerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)

    class Meta:
        model = ExternalBackend
        fields = [
            "id",
            "tenant",
            "model",
            "base_url",
            "secret_name",
            "priority",
            "weight",
            "enabled",
            "created_at",
            "updated_at",
        ]


class ExternalBackendWriteSerializer(StrictSerializer):
    tenant = serializers.CharField(help_text="the tenant's slug")
    model = serializers.CharField(max_length=200)
    base_url = serializers.CharField(max_length=500)
    secret_name = serializers.CharField(max_length=100, required=False, allow_blank=True, default="")
    priority = serializers.IntegerField(min_value=0, max_value=32767, required=False, default=0)
    weight = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False, default=100)
    enabled = serializers.BooleanField(required=False, default=True)


class ExternalBackendUpdateSerializer(StrictSerializer):
    model = serializers.CharField(max_length=200, required=False)
    base_url = serializers.CharField(max_length=500, required=False)
    secret_name = serializers.CharField(max_length=100, required=False, allow_blank=True)
    priority = serializers.IntegerField(min_value=0, max_value=32767, required=False)
    weight = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False)
    enabled = serializers.BooleanField(required=False)


class ServiceRouteSerializer(serializers.Serializer):
    service = serializers.IntegerField(help_text="the inference service's id")
    model = serializers.CharField()
    priority = serializers.IntegerField()
    weight = serializers.IntegerField()


class ServiceRouteUpdateSerializer(StrictSerializer):
    priority = serializers.IntegerField(min_value=0, max_value=32767, required=False)
    weight = serializers.IntegerField(min_value=0, max_value=1_000_000, required=False)
