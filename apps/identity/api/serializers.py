from rest_framework import serializers

from apps.core.serializers import StrictSerializer
from apps.tenants.choices import Role
from apps.tenants.models import Tenant


class MappingSerializer(StrictSerializer):
    group = serializers.CharField(max_length=500)
    tenant = serializers.SlugRelatedField(
        slug_field="slug", queryset=Tenant.objects.all(), allow_null=True, required=False, default=None
    )
    role = serializers.ChoiceField(choices=Role.choices, allow_blank=True, required=False, default="")
    operator = serializers.BooleanField(required=False, default=False)

    def validate_group(self, value):
        if not value.strip():
            raise serializers.ValidationError("Must not be blank.")
        return value.strip()

    def validate(self, data):
        if data["operator"]:
            if data["tenant"] is not None or data["role"]:
                raise serializers.ValidationError(
                    "An operator mapping names no tenant and no role: operators act on every tenant."
                )
        elif data["tenant"] is None or not data["role"]:
            raise serializers.ValidationError("A mapping names a tenant and a role, or sets operator to true.")
        return data

    def to_representation(self, mapping):
        return {
            "group": mapping.group,
            "tenant": mapping.tenant.slug if mapping.tenant_id else None,
            "role": mapping.role or None,
            "operator": mapping.operator,
        }


class MappingTableSerializer(StrictSerializer):
    mappings = MappingSerializer(many=True, allow_empty=True)

    def validate_mappings(self, rows):
        seen = set()
        for index, row in enumerate(rows):
            key = (row["group"].lower(), row["tenant"].pk if row["tenant"] else None)
            if key in seen:
                what = "operator" if row["operator"] else f"tenant '{row['tenant'].slug}'"
                raise serializers.ValidationError(f"Row {index}: group '{row['group']}' maps to {what} twice.")
            seen.add(key)
        return rows
