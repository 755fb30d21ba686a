"""Operators' admin for nodes and GPUs. Nodes register by heartbeat, so the admin adds
none; every change goes through apps.nodes.services, as the API's do (and never saves a
whole node row, which would race with the heartbeats over its columns)."""

from __future__ import annotations

import math

from django import forms
from django.contrib import admin, messages
from django.db.models import Count, Q
from rest_framework.exceptions import APIException

from apps.core.admin_tools import DeleteThroughServiceMixin, operator, refusal
from apps.core.authentication import principal_for_session
from apps.core.errors import Conflict
from apps.nodes import gpu_health_services, services
from apps.nodes.carbon import MAX_FACTOR_G_PER_KWH
from apps.nodes.choices import CORDON_LABEL, CardIdentity, GpuState
from apps.nodes.images_protocol import reference_error
from apps.nodes.models import EmissionFactor, Gpu, ImageRequest, Node, WatchedImage


def gpu_state(gpu: Gpu) -> str:
    """The card's state (read with Gpu.objects.with_state()), a lost one with since when and why."""
    if gpu.state == GpuState.LOST:
        lost = f"LOST since {gpu.lost_at:%Y-%m-%d %H:%M} ({gpu.get_lost_basis_display() or 'unknown basis'})"
        if gpu.matched_by == CardIdentity.POSITION:
            lost += "; which card cannot be told: this is the position that went missing"
        return lost
    return gpu.state


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    can_delete = False
    fields = readonly_fields = [
        "index",
        "model",
        "vendor",
        "memory_total_mb",
        "utilization",
        "memory_used_mb",
        "temperature",
        "power_w",
        "state_shown",
    ]
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False

    def get_queryset(self, request):
        return super().get_queryset(request).with_state()

    @admin.display(description="state")
    def state_shown(self, gpu):
        return gpu_state(gpu)


class NodeForm(forms.ModelForm):
    """What an operator may change here: the location and the owning tenant."""

    seen_version = forms.IntegerField(widget=forms.HiddenInput, required=False)

    class Meta:
        model = Node
        fields = ["region", "zone", "rack", "tenant"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["seen_version"].initial = self.instance.version


@admin.register(Node)
class NodeAdmin(DeleteThroughServiceMixin, admin.ModelAdmin):
    form = NodeForm
    list_display = [
        "name",
        "id",
        "status",
        "in_service",
        "gpu_count",
        "lost_gpus",
        "tenant",
        "location",
        "exec_mode",
        "last_heartbeat_at",
    ]
    list_filter = ["status", "gpu_type", "exec_mode", ("tenant", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["id", "name", "ip", "internal_ip", "hostname", "gpu_model", "region", "zone", "rack"]
    list_select_related = ["tenant"]
    inlines = [GpuInline]
    actions = ["drain", "mark_maintenance", "back_in_service", "delete_through_services"]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    "name",
                    "status",
                    "in_service",
                    "executable",
                    "exec_mode",
                    "error_message",
                    "last_heartbeat_at",
                    "registered_at",
                    "seen_version",
                ]
            },
        ),
        (
            "Location",
            {
                "fields": ["region", "zone", "rack"],
                "description": "An empty field clears that part. Used by the topology plugin.",
            },
        ),
        (
            "Owner",
            {
                "fields": ["tenant"],
                "description": "Empty: shared. Other tenants' tasks already on the node are left to finish (drain).",
            },
        ),
        (
            "Host",
            {
                "fields": [
                    "hostname",
                    "os",
                    "ip",
                    "internal_ip",
                    "internal_prefix",
                    "mac",
                    "cpu_cores",
                    "memory_gb",
                    "is_container",
                    "cpu_used",
                    "memory_used",
                ]
            },
        ),
        ("GPUs", {"fields": ["gpu_type", "gpu_model", "gpu_count", "gpu_collector_error", "gpu_capabilities"]}),
        ("Agent", {"fields": ["agent_version", "agent_git_commit", "agent_build_time", "heartbeat_interval"]}),
        (
            "Labels and models",
            {"fields": ["labels", "discovered_models", "inference_engines", "inference_engine_versions"]},
        ),
    ]
    readonly_fields = [
        "id",
        "name",
        "status",
        "in_service",
        "executable",
        "exec_mode",
        "error_message",
        "last_heartbeat_at",
        "registered_at",
        "hostname",
        "os",
        "ip",
        "internal_ip",
        "internal_prefix",
        "mac",
        "cpu_cores",
        "memory_gb",
        "is_container",
        "cpu_used",
        "memory_used",
        "gpu_type",
        "gpu_model",
        "gpu_count",
        "gpu_collector_error",
        "gpu_capabilities",
        "agent_version",
        "agent_git_commit",
        "agent_build_time",
        "heartbeat_interval",
        "labels",
        "discovered_models",
        "inference_engines",
        "inference_engine_versions",
    ]

    def has_add_permission(self, request):
        return False  # nodes register by their agent's heartbeat

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(lost=Count("gpus", filter=Q(gpus__lost_at__isnull=False)))

    @admin.display(description="lost GPUs", ordering="lost")
    def lost_gpus(self, node):
        return node.lost

    @admin.display(description="location")
    def location(self, node):
        return " / ".join(part or "—" for part in (node.region, node.zone, node.rack))

    @admin.display(description="service")
    def in_service(self, node):
        mode = node.labels.get(CORDON_LABEL)
        return {"drain": "draining (no new tasks)", "maintenance": "maintenance (no new tasks)"}.get(mode, "in service")

    def save_model(self, request, obj, form, change):
        location = {
            field: form.cleaned_data[field].strip() for field in services.LOCATION_FIELDS if field in form.changed_data
        }
        if location:
            services.set_location(obj, location)
        if "tenant" in form.changed_data:
            seen = form.cleaned_data.get("seen_version")
            version = obj.version if seen is None else seen
            try:
                result = services.assign_tenant(
                    obj, form.cleaned_data["tenant"], expected_version=version, mode="drain"
                )
            except Conflict as exc:
                self.message_user(request, f"The owner was not changed: {exc.detail}", messages.ERROR)
                return
            if result.other_tenant_tasks:
                listed = ", ".join(f"#{pk}" for pk in result.other_tenant_tasks)
                self.message_user(
                    request,
                    f"Other tenants' tasks still run on {obj.name}: {listed}. They are left to finish.",
                    messages.WARNING,
                )

    def delete_through_service(self, request, obj):
        services.delete_node(obj)

    @admin.action(description="Drain: no new tasks, the running ones finish")
    def drain(self, request, queryset):
        for node in queryset:
            services.drain_node(node)
        self.message_user(request, f"Draining {queryset.count()} node(s): they take no new task.", messages.SUCCESS)

    @admin.action(description="Maintenance: no new tasks, move their tasks elsewhere")
    def mark_maintenance(self, request, queryset):
        for node in queryset:
            result = services.start_maintenance(node)
            moved = ", ".join(f"#{pk}" for pk in result.requeued) or "none"
            stopping = ", ".join(f"#{pk}" for pk in result.stopping) or "none"
            self.message_user(
                request,
                f"{node.name} is in maintenance. Requeued: {moved}. Stopped by the agent, then requeued: {stopping}.",
                messages.SUCCESS,
            )

    @admin.action(description="Back in service: take tasks again")
    def back_in_service(self, request, queryset):
        for node in queryset:
            services.return_to_service(node)
        self.message_user(request, f"{queryset.count()} node(s) back in service.", messages.SUCCESS)

    @admin.action(description="Delete selected nodes (refused while tasks are active or models are registered)")
    def delete_through_services(self, request, queryset):
        for node in queryset:
            try:
                services.delete_node(node)
            except Conflict as exc:
                self.message_user(request, str(exc.detail), messages.ERROR)
            else:
                self.message_user(request, f"Deleted {node.name}.", messages.SUCCESS)


class LostFilter(admin.SimpleListFilter):
    title = "lost"
    parameter_name = "lost"

    def lookups(self, request, model_admin):
        return [("yes", "lost"), ("no", "present")]

    def queryset(self, request, queryset):
        if self.value() in ("yes", "no"):
            return queryset.filter(lost_at__isnull=self.value() == "no")
        return queryset


class CordonFilter(admin.SimpleListFilter):
    title = "cordon"
    parameter_name = "cordon"

    def lookups(self, request, model_admin):
        return [("health", "cordoned: health"), ("operator", "cordoned: operator"), ("no", "not cordoned")]

    def queryset(self, request, queryset):
        if self.value() == "no":
            return queryset.filter(cordoned_at__isnull=True)
        if self.value() in ("health", "operator"):
            return queryset.filter(cordoned_at__isnull=False, cordon_source=self.value())
        return queryset


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = [
        "node",
        "index",
        "model",
        "vendor",
        "memory_total_mb",
        "state_shown",
        "health_shown",
        "cordon_shown",
        "last_bad_at",
        "lost_at",
        "lost_basis",
    ]
    list_filter = [LostFilter, CordonFilter, "vendor", "lost_basis"]
    search_fields = ["node__id", "node__name", "model", "uuid", "pci_bus_id"]
    list_select_related = ["node"]
    actions = ["forget_lost", "cordon", "uncordon"]
    readonly_fields = [field.name for field in Gpu._meta.fields] + ["state_shown"]

    def has_add_permission(self, request):
        return False

    def get_queryset(self, request):
        return super().get_queryset(request).with_state()

    def has_delete_permission(self, request, obj=None):
        return False  # only a lost card can be removed: the action below

    def has_change_permission(self, request, obj=None):
        return False  # read only: saving the row would race with the heartbeat that writes it

    @admin.display(description="state")
    def state_shown(self, gpu):
        return gpu_state(gpu)

    @admin.display(description="health")
    def health_shown(self, gpu):
        """The latest reading's ECC counts (— when not read, never 0 for unknown)."""
        if not gpu.health:
            return "—"
        health = gpu.health

        def count(*names):
            values = [health[name] for name in names if isinstance(health.get(name), int)]
            return str(max(values)) if values else "—"

        shown = f"ECC corrected {count('ecc_corrected_volatile', 'ecc_corrected_aggregate')}, "
        shown += f"uncorrected {count('ecc_uncorrected_volatile', 'ecc_uncorrected_aggregate')}"
        if health.get("retired_pages_pending") or health.get("remapped_rows_pending"):
            shown += ", pending reset"
        return shown

    @admin.display(description="cordon", ordering="cordoned_at")
    def cordon_shown(self, gpu):
        if gpu.cordoned_at is None:
            return "—"
        return f"{gpu.cordon_source} since {gpu.cordoned_at:%Y-%m-%d %H:%M}: {gpu.cordon_reason}"

    def _each_card(self, request, queryset, act, done: str) -> None:
        """`act(gpu)` on each selected card through its service; a refusal is reported
        for that card and the others go on. `done` names what was done ("Removed")."""
        for gpu in queryset.select_related("node"):
            try:
                act(gpu)
            except APIException as exc:
                self.message_user(request, refusal(exc), messages.ERROR)
            else:
                self.message_user(request, f"{done} GPU {gpu.index} of {gpu.node.name}.", messages.SUCCESS)

    @admin.action(description="Remove lost cards (taken out of the machine)")
    def forget_lost(self, request, queryset):
        self._each_card(request, queryset, lambda gpu: services.forget_lost_gpu(gpu.node, gpu.index), "Removed")

    @admin.action(description="Cordon: no new placement on the selected cards (their tasks run on)")
    def cordon(self, request, queryset):
        principal = principal_for_session(request, request.user)
        self._each_card(
            request,
            queryset,
            lambda gpu: gpu_health_services.cordon_card(gpu.node, gpu.index, "cordoned in the admin", principal),
            "Cordoned",
        )

    @admin.action(description="Uncordon: the selected cards take placements again (recovers GPU_UNHEALTHY)")
    def uncordon(self, request, queryset):
        principal = principal_for_session(request, request.user)
        self._each_card(
            request,
            queryset,
            lambda gpu: gpu_health_services.uncordon_card(gpu.node, gpu.index, principal),
            "Uncordoned",
        )


# --- the image channel (docs/images.md) -------------------------------------------------------


class WatchedImageForm(forms.ModelForm):
    class Meta:
        model = WatchedImage
        fields = ["vendor", "reference", "kind", "note"]

    def clean_reference(self):
        reference = self.cleaned_data["reference"]
        problem = reference_error(reference)
        if problem:
            raise forms.ValidationError(problem)
        return reference


@admin.register(WatchedImage)
class WatchedImageAdmin(admin.ModelAdmin):
    """The images the nodes of a vendor should have (empty vendor: every node); the
    environment page checks them. The defaults seeded by nodes/0010 say so in their note."""

    form = WatchedImageForm
    list_display = ["reference", "vendor_shown", "kind", "note", "updated_at"]
    list_filter = ["vendor", "kind"]
    search_fields = ["reference", "note"]

    @admin.display(description="vendor", ordering="vendor")
    def vendor_shown(self, watched):
        return watched.vendor or "every vendor"


@admin.register(ImageRequest)
class ImageRequestAdmin(admin.ModelAdmin):
    """Read only: requests are made through the API (or the environment page) and moved
    by the agent's reports and the janitor, each a compare-and-set."""

    list_display = ["id", "node", "action", "references_shown", "status", "progress_shown", "created_at", "finished_at"]
    list_filter = ["status", "action"]
    search_fields = ["node__id", "node__name", "error"]
    list_select_related = ["node"]
    readonly_fields = [field.name for field in ImageRequest._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="references")
    def references_shown(self, row):
        return ", ".join(row.references)[:120]

    @admin.display(description="progress")
    def progress_shown(self, row):
        done, total = row.progress.get("layers_done"), row.progress.get("layers_total")
        return f"{done}/{total} layers" if done is not None and total else (row.progress.get("message") or "—")


class EmissionFactorForm(forms.ModelForm):
    """The API's bounds (apps.nodes.api.serializers.EmissionFactorWriteSerializer)."""

    class Meta:
        model = EmissionFactor
        fields = ["region", "g_co2e_per_kwh", "source"]

    def clean_g_co2e_per_kwh(self):
        value = self.cleaned_data["g_co2e_per_kwh"]
        if not math.isfinite(value) or not 0 <= value <= MAX_FACTOR_G_PER_KWH:
            raise forms.ValidationError(f"A factor is between 0 and {MAX_FACTOR_G_PER_KWH:g} g CO2e/kWh.")
        return value


@admin.register(EmissionFactor)
class EmissionFactorAdmin(DeleteThroughServiceMixin, admin.ModelAdmin):
    """Grid carbon intensity per region (docs/energy.md#carbon): a node in the region with
    no factor of its own is covered by it; with none, no absolute carbon figure is shown.
    Saved and deleted through apps.nodes.services, recorded in the operators' log."""

    form = EmissionFactorForm
    list_display = ["region", "g_co2e_per_kwh", "source", "nodes_covered", "updated_at"]
    search_fields = ["region", "source"]

    @admin.display(description="nodes covered")
    def nodes_covered(self, factor):
        return Node.objects.filter(region=factor.region, emission_factor_g_per_kwh__isnull=True).count()

    def save_model(self, request, obj, form, change):
        if change and "region" in form.changed_data:  # renamed: the old region loses its factor
            old = EmissionFactor.objects.get(pk=obj.pk)
            services.delete_emission_factor(old, operator(request))
        saved, _ = services.put_emission_factor(obj.region, obj.g_co2e_per_kwh, obj.source, operator(request))
        obj.pk = saved.pk

    def delete_through_service(self, request, factor):
        services.delete_emission_factor(factor, operator(request))
