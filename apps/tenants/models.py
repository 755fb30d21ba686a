from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.functions import Lower
from django_tenants.models import DomainMixin, TenantMixin

from apps.core.models import TenantOwned
from apps.core.scoping import ScopedQuerySet
from apps.tenants.choices import KeyScope, Role


class TenantQuerySet(ScopedQuerySet):
    tenant_field = "pk"


class Tenant(TenantMixin):
    """A customer of the platform. Its schema holds what is confidential to it."""

    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=40, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Quotas: None means unlimited. Enforced at task creation (tasks app).
    max_gpus = models.PositiveIntegerField(null=True, blank=True)
    max_gpu_memory_mb = models.PositiveBigIntegerField(null=True, blank=True)
    max_concurrent_tasks = models.PositiveIntegerField(null=True, blank=True)
    # interactive tasks (docs/interactive.md): how long one may sit idle before it is
    # stopped, when it names no time of its own, and the most it may name. None: the
    # platform's (HETEROFLOW_INTERACTIVE_IDLE_MINUTES, …_MAX)
    interactive_idle_minutes = models.PositiveIntegerField(null=True, blank=True)
    interactive_idle_minutes_max = models.PositiveIntegerField(null=True, blank=True)

    auto_create_schema = True
    auto_drop_schema = True

    objects = TenantQuerySet.as_manager()

    class Meta:
        db_table = "tenants"
        ordering = ["name"]
        constraints = [models.UniqueConstraint(Lower("name"), name="tenants_name_ci_unique")]

    def __str__(self):
        return self.name

    def create_schema(self, check_if_exists=False, sync_schema=True, verbosity=1):
        """The tenant's schema with only what lives there (TENANT_APPS) migrated: about
        50 ms, where django-tenants' default replays every app's migrations in it (4 s per
        tenant, for tables the router keeps in public anyway). The other apps' migrations
        are recorded in the schema by the next `migrate_schemas`, where they are no-ops."""
        from django.apps import apps
        from django.conf import settings
        from django.core.management import call_command
        from django.db import connection
        from django_tenants.postgresql_backend.base import _check_schema_name
        from django_tenants.utils import schema_exists

        _check_schema_name(self.schema_name)
        if check_if_exists and schema_exists(self.schema_name):
            return False
        with connection.cursor() as cursor:
            cursor.execute(f'CREATE SCHEMA "{self.schema_name}"')
        if sync_schema:
            for config in apps.get_app_configs():
                if config.name in settings.TENANT_APPS:
                    call_command(
                        "migrate_schemas",
                        config.label,
                        tenant=True,
                        schema_name=self.schema_name,
                        interactive=False,
                        verbosity=verbosity,
                    )
        connection.set_schema_to_public()
        return True


class Domain(DomainMixin, TenantOwned):
    """Required by django-tenants; requests are not routed by host name here."""

    class Meta:
        db_table = "tenant_domains"


class TenantGroup(models.Model):
    """Tenants that may share physical GPUs. Outside a common group, tenants never share."""

    name = models.CharField(max_length=100, unique=True)
    description = models.TextField(blank=True, default="")
    tenants = models.ManyToManyField(Tenant, related_name="groups", blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "tenant_groups"
        ordering = ["name"]

    def __str__(self):
        return self.name


class MembershipQuerySet(ScopedQuerySet):
    tenant_field = "tenant"

    def by_tenant_name(self):
        """A user's tenants as a session chooses among them (the first is the default one,
        apps.core.authentication.principal_for_session), GET /api/v1/me lists them and the
        portal's switcher offers them: `user.memberships.by_tenant_name()`."""
        return self.select_related("tenant").order_by("tenant__name")


class Membership(TenantOwned):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = MembershipQuerySet.as_manager()

    class Meta:
        db_table = "tenant_memberships"
        ordering = ["tenant__name", "user__username"]
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="membership_unique")]

    def __str__(self):
        return f"{self.user} in {self.tenant} ({self.role})"


class ApiKeyQuerySet(ScopedQuerySet):
    tenant_field = "tenant"

    def visible_to(self, principal):
        scoped = super().visible_to(principal)
        # Admins manage every key of their tenant; others see only their own keys.
        if principal.is_tenant and not principal.is_tenant_admin:
            scoped = scoped.filter(user=principal.user)
        return scoped


class ApiKey(TenantOwned):
    """An API key. Only a SHA-256 of the key is stored: keys are 256-bit random, so a fast
    hash is safe and lets a request find its key with one indexed lookup."""

    scope = models.CharField(max_length=10, choices=KeyScope.choices)
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="api_keys")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    role = models.CharField(max_length=10, choices=Role.choices, blank=True, default="")
    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True)
    display_prefix = models.CharField(max_length=24)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        db_table = "api_keys"
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(scope=KeyScope.TENANT, tenant__isnull=False) & ~models.Q(role=""))
                | models.Q(scope=KeyScope.PLATFORM, tenant__isnull=True, role=""),
                name="api_key_scope_shape",
            )
        ]

    def __str__(self):
        return f"{self.name} ({self.display_prefix}…)"

    def is_usable_at(self, now) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


class Cohort(models.Model):
    """Tenants that lend their idle nominal cards to each other and borrow them
    (docs/queues.md). Not a tenant group: a group decides who may share a physical card,
    a cohort whose idle cards another may use."""

    name = models.SlugField(max_length=40, unique=True)
    description = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "cohorts"
        ordering = ["name"]

    def __str__(self):
        return self.name


class TenantQueue(TenantOwned):
    """A tenant's share of the fleet: its cohort, its fair-share weight, its quotas per GPU
    type (QueueQuota), and its usage above nominal, decayed (card-seconds as of
    `usage_at`; kept by the scheduler.queue_usage job). A tenant without one is not
    limited by queues."""

    tenant = models.OneToOneField(Tenant, primary_key=True, on_delete=models.CASCADE, related_name="queue")
    cohort = models.ForeignKey(Cohort, null=True, blank=True, on_delete=models.PROTECT, related_name="queues")
    weight = models.FloatField(default=1.0)
    usage_above_nominal = models.FloatField(default=0.0, help_text="card-seconds above nominal, decayed")
    usage_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "tenant_queues"

    def __str__(self):
        return f"queue of tenant {self.tenant_id}"


class QueueQuota(models.Model):
    """One GPU type (vendor) of a tenant's queue: `nominal` cards guaranteed, how far above
    it the tenant may borrow (`borrowing_limit`), how much of its idle nominal others may
    use (`lending_limit`); null: no limit."""

    queue = models.ForeignKey(TenantQueue, on_delete=models.CASCADE, related_name="quotas")
    gpu_type = models.CharField(max_length=32)
    nominal = models.PositiveIntegerField(default=0)
    borrowing_limit = models.PositiveIntegerField(null=True, blank=True)
    lending_limit = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        db_table = "queue_quotas"
        ordering = ["gpu_type"]
        constraints = [models.UniqueConstraint(fields=["queue", "gpu_type"], name="queue_quota_type_once")]

    def __str__(self):
        return f"{self.gpu_type}: {self.nominal}"
