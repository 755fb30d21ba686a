"""Operators' admin for the model registry and the inference services: read, filter,
search. Models are registered and changed, services deployed, scaled, stopped and woken
through the API or the portal, where their validation and their services live; the admin
only deletes models, through the same pre-check as the API (apps.inference.model_deletion:
a model a service not stopped uses is refused, naming the services)."""

from django.contrib import admin

from apps.core.admin_tools import DeleteThroughServiceMixin, operator
from apps.inference import model_deletion
from apps.inference.models import InferenceService, Model, ServiceDecision, ServiceLoan


@admin.register(Model)
class ModelAdmin(DeleteThroughServiceMixin, admin.ModelAdmin):
    list_display = ["name", "tenant", "format", "source_kind", "source", "size_bytes", "created_at"]
    list_filter = ["format", "source_kind", "tenant"]
    search_fields = ["name", "source"]
    readonly_fields = [
        "tenant",
        "name",
        "source_kind",
        "source",
        "format",
        "size_bytes",
        "engines",
        "registered_nodes",
        "created_at",
        "updated_at",
    ]
    exclude = ["nodes"]

    @admin.display(description="nodes")
    def registered_nodes(self, obj):
        return ", ".join(sorted(node.pk for node in obj.nodes.all())) or "—"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def get_deleted_objects(self, objs, request):
        """The records of stopped services go with their model (model_deletion), so they
        neither protect it nor ask for a permission here; the services not stopped are
        the protected objects the confirmation page lists."""
        deleted, counts, perms_needed, _ = super().get_deleted_objects(objs, request)
        perms_needed = {name for name in perms_needed if name != InferenceService._meta.verbose_name}
        protected = [
            f"Inference service: {service}" for model in objs for service in model_deletion.services_using(model)
        ]
        return deleted, counts, perms_needed, protected

    def delete_through_service(self, request, model):
        model_deletion.delete_model(operator(request), model)


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class ServiceDecisionInline(ReadOnlyInline):
    """The service's decisions with their reasons, newest first (the latest 100)."""

    model = ServiceDecision
    fields = readonly_fields = ["created_at", "source", "action", "from_replicas", "to_replicas", "reason"]
    ordering = ["-created_at", "-id"]
    shown = 100

    def get_formset(self, request, obj=None, **kwargs):
        request.decisions_of = obj  # the admin asks for the formset, then for its queryset
        return super().get_formset(request, obj, **kwargs)

    def get_queryset(self, request):
        queryset = super().get_queryset(request)
        service = getattr(request, "decisions_of", None)
        if service is None:
            return queryset
        recent = queryset.filter(service=service).order_by("-created_at", "-id").values_list("pk", flat=True)
        return queryset.filter(pk__in=list(recent[: self.shown]))


class ServiceLoanInline(ReadOnlyInline):
    """The service's loans of idle cards to training, newest first (the wake patrol gives
    them back; nothing is changed here)."""

    model = ServiceLoan
    fk_name = "service"
    fields = readonly_fields = [
        "created_at",
        "borrower",
        "borrower_group",
        "node_id",
        "from_replicas",
        "to_replicas",
        "sleeps",
        "state",
        "returned_at",
        "returned_why",
    ]
    ordering = ["-created_at", "-id"]


@admin.register(InferenceService)
class InferenceServiceAdmin(admin.ModelAdmin):
    list_display = ["group_id", "name", "tenant", "model", "engine", "replicas", "bounds", "state", "created_at"]
    list_filter = ["state", "engine", ("group__tenant", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["=group__id", "group__name", "model__name"]
    list_select_related = ["group__tenant", "model"]
    date_hierarchy = "created_at"
    inlines = [ServiceLoanInline, ServiceDecisionInline]
    readonly_fields = [field.name for field in InferenceService._meta.fields]

    @admin.display(description="name", ordering="group__name")
    def name(self, service):
        return service.group.name

    @admin.display(description="tenant", ordering="group__tenant__slug")
    def tenant(self, service):
        return service.group.tenant.slug

    @admin.display(description="min–max")
    def bounds(self, service):
        return f"{service.min_replicas}–{service.max_replicas}"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # a service is stopped (API, portal), never deleted under its running replicas
