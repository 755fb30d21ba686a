"""GET /api/v1/usage/energy: the energy and carbon of a tenant's tasks' GPU time
(docs/energy.md#tenants). A tenant's principals see their own tenant; operators name one
with ?tenant= (none: the whole platform). Carbon follows apps.nodes.carbon's role rule."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.serializers import StrictSerializer
from apps.nodes import carbon
from apps.tasks.selectors import tenant_energy
from apps.tenants import policy


class EnergyQuerySerializer(StrictSerializer):
    days = serializers.IntegerField(min_value=1, max_value=366, default=30)
    tenant = serializers.CharField(max_length=100, required=False, help_text="Operators: a tenant's slug.")
    top = serializers.IntegerField(min_value=1, max_value=100, default=10, help_text="How many tasks to rank.")


class CarbonSerializer(serializers.Serializer):
    basis = serializers.ChoiceField(
        choices=[(basis, basis) for basis in carbon.BASES],
        help_text=(
            "factor: a factor covered all of the energy; partial: some had none (unfactored_kwh); no_factor: none "
            "did (no absolute figure); no_data: nothing measured; not_visible: not the viewer's tenant."
        ),
    )
    carbon_g = serializers.FloatField(allow_null=True, help_text="g CO2e, settled with each node's factor.")
    unfactored_kwh = serializers.FloatField(allow_null=True, help_text="Energy no factor covered.")
    configure = serializers.CharField(required=False, help_text="Operators, no factor: how to configure one.")


class TaskEnergySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    status = serializers.CharField()
    running = serializers.BooleanField(help_text="Holding its cards now: the figures grow until it ends.")
    gpu_hours = serializers.FloatField()
    energy_kwh = serializers.FloatField()
    carbon = CarbonSerializer()


class TenantEnergySerializer(serializers.Serializer):
    tenant = serializers.CharField(allow_null=True, help_text="null: every tenant (operators).")
    days = serializers.IntegerField()
    since = serializers.DateTimeField()
    tasks_settled = serializers.IntegerField(help_text="Tasks that ended in the window.")
    tasks_running = serializers.IntegerField(help_text="Tasks holding cards now.")
    tasks_measured = serializers.IntegerField(help_text="Of those, the ones whose cards measured power.")
    gpu_hours = serializers.FloatField()
    energy_kwh = serializers.FloatField(allow_null=True, help_text="null: none of the tasks' cards measured power.")
    carbon = CarbonSerializer()
    top_tasks = TaskEnergySerializer(many=True)


def kwh(wh: float | None) -> float | None:
    return None if wh is None else wh / 1000.0


def present_tenant_energy(principal, tenant, *, days: int = 30, top: int = 10) -> dict:
    """The answer of GET /api/v1/usage/energy and the portal's energy page: the sums of
    apps.tasks.selectors.tenant_energy with carbon shown under the role rule."""
    tenant_id = tenant.pk if tenant is not None else None
    data = tenant_energy(tenant_id, days=days, top=top)

    def carbon_of(row_tenant_id, energy_wh, carbon_g, unfactored_wh):
        return carbon.settled_carbon(
            principal, row_tenant_id, energy_wh=energy_wh, carbon_g=carbon_g, unfactored_wh=unfactored_wh
        )

    return {
        "tenant": tenant.slug if tenant is not None else None,
        "days": data["days"],
        "since": data["since"],
        "tasks_settled": data["tasks_settled"],
        "tasks_running": data["tasks_running"],
        "tasks_measured": data["tasks_measured"],
        "gpu_hours": data["gpu_hours"],
        "energy_kwh": kwh(data["energy_wh"]),
        "carbon": carbon_of(tenant_id, data["energy_wh"], data["carbon_g"], data["unfactored_wh"]),
        "top_tasks": [
            {
                "id": row["id"],
                "name": row["name"],
                "status": row["status"],
                "running": row["running"],
                "gpu_hours": row["gpu_seconds"] / 3600.0,
                "energy_kwh": kwh(row["energy_wh"]),
                "carbon": carbon_of(tenant_id, row["energy_wh"], row["carbon_g"], row["unfactored_wh"]),
            }
            for row in data["top_tasks"]
        ],
    }


def energy_tenant(principal, slug: str | None):
    """The tenant asked about: the named one (404 outside the caller's scope), else the
    caller's own; an operator naming none asks about the whole platform (None)."""
    if slug is not None:
        return policy.tenant_by_slug(principal, slug)
    if principal.is_tenant:
        return principal.tenant
    return None


class TenantEnergyView(APIView):
    @extend_schema(parameters=[EnergyQuerySerializer], responses=TenantEnergySerializer)
    def get(self, request):
        query = EnergyQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        params = query.validated_data
        tenant = energy_tenant(request.auth, params.get("tenant"))
        return Response(present_tenant_energy(request.auth, tenant, days=params["days"], top=params["top"]))
