from __future__ import annotations

from django.db import models

from apps.core.scoping import ScopedQuerySet
from apps.inference.choices import ModelFormat, SourceKind


class ModelQuerySet(ScopedQuerySet):
    tenant_field = "tenant"


class Model(models.Model):
    """A model a tenant registered: what clients name in `"model"`, where its weights come
    from, their format and size, the engines that can serve it, and optionally the nodes it
    is registered on (node pinning). Where it is cached is not stored: it is joined from
    the nodes' reports (apps.inference.selectors.cached_on)."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="inference_models")
    name = models.CharField(max_length=200, help_text='What clients put in "model"; unique per tenant.')
    source_kind = models.CharField(max_length=10, choices=SourceKind.choices)
    source = models.CharField(max_length=1024, help_text="The path, the image reference or the hub id.")
    format = models.CharField(max_length=20, choices=ModelFormat.choices)
    size_bytes = models.BigIntegerField(null=True, blank=True, help_text="Empty: not known.")
    engines = models.JSONField(
        default=list, blank=True, help_text="Engines that can serve it; empty: the engine router chooses by format."
    )
    nodes = models.ManyToManyField(
        "nodes.Node",
        blank=True,
        related_name="registered_models",
        help_text="The nodes it is registered on; empty: not pinned. A node with registrations is not deleted "
        "without force.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ModelQuerySet.as_manager()

    class Meta:
        db_table = "inference_models"
        ordering = ["name", "id"]
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="inference_model_tenant_name_unique")]
        indexes = [models.Index(fields=["tenant", "format"], name="inference_models_tenant_format")]

    def __str__(self):
        return self.name
