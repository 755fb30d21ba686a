from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.validators import RegexValidator
from rest_framework import serializers

from apps.core.clock import utcnow
from apps.core.serializers import StrictModelSerializer, StrictSerializer
from apps.tenants.choices import KeyScope, Role
from apps.tenants.models import ApiKey, Membership, Tenant, TenantGroup

slug_validator = RegexValidator(
    r"^[a-z][a-z0-9-]{1,38}[a-z0-9]$",
    "3-40 characters: lowercase letters, digits and '-', starting with a letter, not ending with '-'.",
)


# a tenant's interactive tasks (docs/interactive.md): the idle time they get by default,
# and the most they may ask for
INTERACTIVE_FIELDS = ("interactive_idle_minutes", "interactive_idle_minutes_max")


def idle_problem(default: int | None, ceiling: int | None) -> str:
    if default is not None and ceiling is not None and default > ceiling:
        return f"The default idle time ({default} minutes) is over the ceiling ({ceiling})."
    return ""


def check_idle(attrs: dict, tenant) -> None:
    """The default within the ceiling, as they will be once `attrs` are written."""
    merged = {name: attrs.get(name, getattr(tenant, name, None)) for name in INTERACTIVE_FIELDS}
    problem = idle_problem(*merged.values())
    if problem:
        raise serializers.ValidationError({"interactive_idle_minutes": [problem]})


class TenantSerializer(StrictModelSerializer):
    slug = serializers.CharField(validators=[slug_validator])
    name = serializers.CharField(max_length=100)

    class Meta:
        model = Tenant
        fields = [
            "slug",
            "name",
            "created_at",
            "max_gpus",
            "max_gpu_memory_mb",
            "max_concurrent_tasks",
            *INTERACTIVE_FIELDS,
        ]
        read_only_fields = ["created_at"]

    def validate(self, attrs):
        check_idle(attrs, self.instance)
        return attrs

    def validate_name(self, value):
        if not value.strip():
            raise serializers.ValidationError("Must not be blank.")
        return value.strip()


class TenantUpdateSerializer(StrictModelSerializer):
    class Meta:
        model = Tenant
        fields = ["name", "max_gpus", "max_gpu_memory_mb", "max_concurrent_tasks", *INTERACTIVE_FIELDS]
        extra_kwargs = {name: {"required": False} for name in fields}

    def validate(self, attrs):
        check_idle(attrs, self.instance)
        return attrs


class MemberSerializer(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username")
    email = serializers.EmailField(source="user.email")

    class Meta:
        model = Membership
        fields = ["username", "email", "role", "created_at"]


class MemberCreateSerializer(StrictSerializer):
    username = serializers.RegexField(r"^[\w.@+-]{1,150}$", max_length=150)
    email = serializers.EmailField(required=False, allow_blank=True, default="")
    role = serializers.ChoiceField(choices=Role.choices, default=Role.MEMBER)
    password = serializers.CharField(required=False, write_only=True, style={"input_type": "password"})

    def validate(self, attrs):
        if "password" in attrs:
            try:
                validate_password(attrs["password"])
            except DjangoValidationError as exc:
                raise serializers.ValidationError({"password": list(exc.messages)}) from None
        return attrs


class MemberCreatedSerializer(MemberSerializer):
    user_created = serializers.BooleanField()
    initial_password = serializers.CharField(allow_null=True, help_text="Shown once, when generated.")

    class Meta(MemberSerializer.Meta):
        fields = MemberSerializer.Meta.fields + ["user_created", "initial_password"]


class MemberUpdateSerializer(StrictSerializer):
    role = serializers.ChoiceField(choices=Role.choices)


class ApiKeySerializer(serializers.ModelSerializer):
    tenant = serializers.SlugRelatedField(
        slug_field="slug", read_only=True, allow_null=True, help_text="null: a platform (operator) key"
    )
    username = serializers.CharField(source="user.username", read_only=True)
    active = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "scope",
            "tenant",
            "username",
            "role",
            "name",
            "display_prefix",
            "created_at",
            "expires_at",
            "last_used_at",
            "revoked_at",
            "active",
        ]

    def get_active(self, obj) -> bool:
        return obj.is_usable_at(utcnow())


class ApiKeyCreateSerializer(StrictSerializer):
    scope = serializers.ChoiceField(choices=KeyScope.choices, default=KeyScope.TENANT)
    tenant = serializers.CharField(required=False, help_text="Tenant slug; defaults to the caller's tenant.")
    username = serializers.CharField(required=False, help_text="The member the key acts as; defaults to the caller.")
    role = serializers.ChoiceField(choices=Role.choices, required=False, help_text="At most the member's role.")
    name = serializers.CharField(max_length=100)
    expires_at = serializers.DateTimeField(required=False, allow_null=True)

    def validate_expires_at(self, value):
        if value is not None and value <= utcnow():
            raise serializers.ValidationError("Must be in the future.")
        return value

    def validate(self, attrs):
        if attrs["scope"] == KeyScope.PLATFORM:
            extra = [name for name in ("tenant", "username", "role") if attrs.get(name)]
            if extra:
                raise serializers.ValidationError(
                    {name: ["Platform keys have no tenant, member or role."] for name in extra}
                )
        return attrs


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(help_text="The key itself. Shown once; store it now.")

    class Meta(ApiKeySerializer.Meta):
        fields = ApiKeySerializer.Meta.fields + ["key"]


class TenantGroupSerializer(StrictModelSerializer):
    tenants = serializers.SlugRelatedField(slug_field="slug", many=True, queryset=Tenant.objects.all(), required=False)

    class Meta:
        model = TenantGroup
        fields = ["id", "name", "description", "tenants", "created_at"]
        read_only_fields = ["id", "created_at"]
        # Uniqueness is the service's to report (409), not a 400.
        extra_kwargs = {"name": {"validators": []}}


class AuditEventSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    actor = serializers.CharField()
    action = serializers.CharField()
    target = serializers.CharField()
    details = serializers.JSONField()


class OperatorAuditEventSerializer(AuditEventSerializer):
    tenant = serializers.CharField(help_text="The tenant's slug; empty: a change to the platform.")


class MembershipBriefSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    role = serializers.ChoiceField(choices=Role.choices)


class PrincipalSerializer(serializers.Serializer):
    kind = serializers.CharField()
    username = serializers.CharField()
    tenant = serializers.CharField(allow_null=True)
    role = serializers.CharField(allow_null=True)
    memberships = MembershipBriefSerializer(many=True)
