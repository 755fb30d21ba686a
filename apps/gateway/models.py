"""The gateway's tables: endpoint keys (what programs call /v1/* with), the per-tenant
limits, and the usage buckets the gateway meters into."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from apps.core.models import TenantOwned
from apps.core.scoping import ScopedQuerySet


class EndpointKeyQuerySet(ScopedQuerySet):
    tenant_field = "tenant"


class EndpointKey(TenantOwned):
    """A key for the OpenAI-compatible endpoints of one tenant (`sk-hf-…`). Only a SHA-256
    of it is stored (256-bit random, so a fast hash is safe and one indexed lookup finds
    it); it is shown once, at creation and at each rotation. A rotation gives the key a
    new secret and keeps the previous one valid until `previous_valid_until`, so programs
    can move over; the row (its limits, its usage) stays the same key."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="endpoint_keys")
    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True)
    display_prefix = models.CharField(max_length=24)
    previous_key_hash = models.CharField(max_length=64, null=True, blank=True, unique=True)
    previous_display_prefix = models.CharField(max_length=24, blank=True, default="")
    previous_valid_until = models.DateTimeField(null=True, blank=True)
    allowed_models = models.JSONField(
        default=list, blank=True, help_text="model names this key may call; empty: every model of the tenant"
    )
    rpm_limit = models.PositiveIntegerField(null=True, blank=True, help_text="requests per minute; empty: no limit")
    tpm_limit = models.PositiveIntegerField(null=True, blank=True, help_text="tokens per minute; empty: no limit")
    concurrency_limit = models.PositiveIntegerField(
        null=True, blank=True, help_text="requests in flight at once; empty: no limit"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    rotated_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = EndpointKeyQuerySet.as_manager()

    class Meta:
        db_table = "gateway_endpoint_keys"
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="gateway_keys_tenant")]

    def __str__(self):
        return f"{self.name} ({self.display_prefix}…)"

    def is_usable_at(self, now) -> bool:
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)


class TenantLimits(TenantOwned):
    """A tenant's gateway limits over all its keys (set by operators); no row or an empty
    field: no limit."""

    tenant = models.OneToOneField(
        "tenants.Tenant", on_delete=models.CASCADE, primary_key=True, related_name="gateway_limits"
    )
    rpm_limit = models.PositiveIntegerField(null=True, blank=True)
    tpm_limit = models.PositiveIntegerField(null=True, blank=True)
    concurrency_limit = models.PositiveIntegerField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "gateway_tenant_limits"

    def __str__(self):
        return f"limits of {self.tenant_id}"


class ServiceRouteQuerySet(ScopedQuerySet):
    tenant_field = "service__group__tenant"


class ServiceRoute(models.Model):
    """How the gateway shares a model name among the tenant's services that serve it: the
    services of the highest priority with a healthy replica take the requests, split by
    weight; the others are the fallback. No row: priority 0, weight 100."""

    service = models.OneToOneField(
        "inference.InferenceService", on_delete=models.CASCADE, primary_key=True, related_name="gateway_route"
    )
    priority = models.PositiveSmallIntegerField(default=0, help_text="higher first; lower ones are the fallback")
    weight = models.PositiveIntegerField(default=100, help_text="share among the services of one priority")
    updated_at = models.DateTimeField(auto_now=True)

    objects = ServiceRouteQuerySet.as_manager()

    class Meta:
        db_table = "gateway_service_routes"

    def __str__(self):
        return f"route of service {self.service_id}: priority {self.priority}, weight {self.weight}"


class ExternalBackendQuerySet(ScopedQuerySet):
    tenant_field = "tenant"


class ExternalBackend(TenantOwned):
    """An existing OpenAI-compatible server an operator puts behind a tenant's keys, limits
    and metering under a model name (apps.gateway.external checks the URL). The bearer
    token it takes is the value of the tenant's secret `secret_name` (in the tenant's own
    schema), never stored here. It routes with the tenant's services of the same name by
    priority and weight."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="gateway_backends")
    model = models.CharField(max_length=200, help_text='the name clients put in "model"')
    base_url = models.CharField(max_length=500, help_text="e.g. https://llm.example.com/v1; /v1/... is appended")
    secret_name = models.CharField(max_length=100, blank=True, default="", help_text="a tenant secret; empty: none")
    priority = models.PositiveSmallIntegerField(default=0)
    weight = models.PositiveIntegerField(default=100)
    enabled = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ExternalBackendQuerySet.as_manager()

    class Meta:
        db_table = "gateway_external_backends"
        ordering = ["tenant_id", "model", "id"]
        indexes = [models.Index(fields=["tenant", "model"], name="gateway_external_tenant_model")]

    def __str__(self):
        return f"{self.model} → {self.base_url}"


class UsageQuerySet(ScopedQuerySet):
    tenant_field = "tenant"


class UsageBucket(TenantOwned):
    """What one key used of one model (served by one service) in one minute: requests,
    errors, prompt and completion tokens, GPU-seconds (each request's share of its
    replica's cards while it held them, apps.gateway.usage.ShareClock). Written in
    batches off the request path: an upsert that adds to the minute's row."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    key = models.ForeignKey(EndpointKey, null=True, on_delete=models.SET_NULL, related_name="usage")
    model = models.CharField(max_length=200)
    service_id = models.BigIntegerField(null=True, blank=True, help_text="the inference service's group id")
    minute = models.DateTimeField()
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    # a database default too: a gateway process of the release before, still writing
    # during a rolling upgrade, leaves it out of its upsert
    gpu_seconds = models.FloatField(
        default=0.0, db_default=0.0, help_text="the requests' shares of their replicas' cards, in GPU-seconds"
    )

    objects = UsageQuerySet.as_manager()

    class Meta:
        db_table = "gateway_usage"
        ordering = ["-minute", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "key", "model", "service_id", "minute"],
                name="gateway_usage_bucket_unique",
                nulls_distinct=False,
            )
        ]
        indexes = [models.Index(fields=["tenant", "-minute"], name="gateway_usage_tenant_minute")]
