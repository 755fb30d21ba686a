import logging

from rest_framework import serializers

from apps.core.error_codes import CoreErrorCode
from apps.monitoring.metrics import record_ignored_agent_fields

logger = logging.getLogger(__name__)


class StrictSerializer(serializers.Serializer):
    """Rejects fields it does not know, naming each one, together with any other errors."""

    def to_internal_value(self, data):
        unknown = {}
        if isinstance(data, dict):
            writable = {name for name, field in self.fields.items() if not field.read_only}
            unknown = {
                name: [serializers.ErrorDetail("Unknown field.", code=CoreErrorCode.UNKNOWN_FIELD)]
                for name in data
                if name not in writable
            }
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if unknown and isinstance(exc.detail, dict):
                raise serializers.ValidationError({**exc.detail, **unknown}) from None
            raise
        if unknown:
            raise serializers.ValidationError(unknown)
        return value


class StrictModelSerializer(StrictSerializer, serializers.ModelSerializer):
    pass


class AgentPayloadSerializer(serializers.Serializer):
    """What an agent sends on the task channel (reports, events, lost containers), read
    tolerantly, as the heartbeat is: an agent newer than the server may send a field
    this server does not know, and a rolling upgrade must not make every report fail.
    Such fields are ignored and named in `ignored_fields` once validated (the view
    counts them); the fields it knows are checked as strictly as ever. People's API
    bodies stay strict (StrictSerializer)."""

    channel = "agent"

    def to_internal_value(self, data):
        if isinstance(data, dict):
            writable = {name for name, field in self.fields.items() if not field.read_only}
            self.ignored_fields = sorted(str(name) for name in data if name not in writable)
        return super().to_internal_value(data)

    def is_valid(self, *, raise_exception=False):
        self.ignored_fields = []
        valid = super().is_valid(raise_exception=raise_exception)
        if valid and self.ignored_fields:
            new = record_ignored_agent_fields(self.channel, self.ignored_fields)
            if new:  # once per channel and field in this process, not on every report
                logger.warning(
                    "an agent sends %s fields this server does not know, ignored: %s "
                    "(an agent newer than the server? upgrade the server)",
                    self.channel,
                    ", ".join(new),
                )
        return valid
