"""Notification channels on the API. Input is strict (unknown fields → 400); a webhook's
secret appears only in the answers to a create and to a rotate."""

from __future__ import annotations

from django.core.validators import URLValidator
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.alerts.choices import AlertType, ChannelKind, DeliveryStatus, NotificationEvent, Severity
from apps.alerts.models import NotificationChannel, NotificationDelivery
from apps.core.serializers import StrictSerializer

MAX_RECIPIENTS = 20
URL_MAX_LENGTH = 2000
webhook_url = URLValidator(schemes=["http", "https"], message="Enter an http:// or https:// URL with a host.")


class ChannelSerializer(serializers.ModelSerializer):
    """A channel as read. `url` comes from the channel's schema (context "urls")."""

    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True, help_text="null: an operators' channel")
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    url = serializers.SerializerMethodField(help_text="webhooks only")

    class Meta:
        model = NotificationChannel
        fields = [
            "id",
            "tenant",
            "name",
            "kind",
            "url",
            "recipients",
            "min_severity",
            "types",
            "enabled",
            "created_at",
            "created_by",
            "updated_at",
            "last_success_at",
            "last_failure_at",
            "last_error",
            "consecutive_failures",
        ]
        read_only_fields = fields

    @extend_schema_field(OpenApiTypes.URI)
    def get_url(self, channel) -> str | None:
        if channel.kind != ChannelKind.WEBHOOK:
            return None
        return self.context.get("urls", {}).get(channel.pk)


class ChannelCreatedSerializer(ChannelSerializer):
    secret = serializers.CharField(
        read_only=True,
        allow_null=True,
        help_text="The webhook's signing secret. Shown in this answer only; null for e-mail channels.",
    )

    class Meta(ChannelSerializer.Meta):
        fields = [*ChannelSerializer.Meta.fields, "secret"]
        read_only_fields = fields


class ChannelSecretSerializer(serializers.Serializer):
    id = serializers.IntegerField(read_only=True)
    secret = serializers.CharField(read_only=True, help_text="The new signing secret. Shown in this answer only.")


class _ChannelFields(StrictSerializer):
    name = serializers.CharField(max_length=100)
    url = serializers.CharField(
        max_length=URL_MAX_LENGTH, validators=[webhook_url], help_text="webhooks: http or https"
    )
    recipients = serializers.ListField(
        child=serializers.EmailField(), min_length=1, max_length=MAX_RECIPIENTS, help_text="e-mail channels: addresses"
    )
    min_severity = serializers.ChoiceField(choices=Severity.choices, default=Severity.INFO)
    types = serializers.ListField(
        child=serializers.ChoiceField(choices=AlertType.choices),
        max_length=len(AlertType.choices),
        default=list,
        help_text="alert types sent; empty: every type",
    )
    enabled = serializers.BooleanField(default=True)

    def validate_recipients(self, value):
        seen = {}
        for address in value:
            seen.setdefault(address.lower(), address)
        return list(seen.values())

    def validate_types(self, value):
        return list(dict.fromkeys(value))

    def check_kind(self, kind: str, data: dict, *, creating: bool) -> None:
        errors = {}
        if kind == ChannelKind.WEBHOOK:
            if "recipients" in data:
                errors["recipients"] = ["Only e-mail channels have recipients."]
            if creating and "url" not in data:
                errors["url"] = ["Required for a webhook channel."]
        else:
            if "url" in data:
                errors["url"] = ["Only webhook channels have a URL."]
            if creating and "recipients" not in data:
                errors["recipients"] = ["Required for an e-mail channel: at least one address."]
        if errors:
            raise serializers.ValidationError(errors)


class ChannelCreateSerializer(_ChannelFields):
    tenant = serializers.SlugField(
        required=False,
        allow_null=True,
        help_text="The tenant the channel belongs to. Tenant principals: their own (the default). "
        "Operators: a tenant's slug, or null/absent for an operators' channel.",
    )
    kind = serializers.ChoiceField(choices=ChannelKind.choices)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["url"].required = False
        self.fields["recipients"].required = False

    def validate(self, data):
        self.check_kind(data["kind"], data, creating=True)
        return data


class ChannelUpdateSerializer(_ChannelFields):
    """Every field optional; `kind` and `tenant` never change. The channel's kind comes in
    the context."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("partial", True)
        super().__init__(*args, **kwargs)

    def validate(self, data):
        self.check_kind(self.context["kind"], data, creating=False)
        return data


class NoBodySerializer(StrictSerializer):
    """Actions that take no input: any field is unknown."""


class TestQueuedSerializer(serializers.Serializer):
    delivery = serializers.IntegerField(read_only=True, help_text="the id of the test delivery")
    status = serializers.ChoiceField(choices=DeliveryStatus.choices, read_only=True)


class DeliverySerializer(serializers.ModelSerializer):
    event = serializers.ChoiceField(choices=NotificationEvent.choices, read_only=True)
    alert = serializers.PrimaryKeyRelatedField(read_only=True)

    class Meta:
        model = NotificationDelivery
        fields = [
            "id",
            "event",
            "alert",
            "status",
            "attempts",
            "last_status_code",
            "last_error",
            "created_at",
            "last_attempt_at",
            "next_attempt_at",
            "delivered_at",
            "failed_at",
        ]
        read_only_fields = fields
