from rest_framework import serializers

from apps.core.errors import UNKNOWN_FIELD_CODE


class StrictSerializer(serializers.Serializer):
    """Rejects fields it does not know, naming each one, together with any other errors."""

    def to_internal_value(self, data):
        unknown = {}
        if isinstance(data, dict):
            writable = {name for name, field in self.fields.items() if not field.read_only}
            unknown = {
                name: [serializers.ErrorDetail("Unknown field.", code=UNKNOWN_FIELD_CODE)]
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
