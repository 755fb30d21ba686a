from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.clock import utcnow
from apps.core.pagination import Pagination
from apps.core.permissions import IsAgent, IsOperator
from apps.core.views import ScopedAPIView
from apps.nodes import carbon, metrics, presenters, selectors, services
from apps.nodes.api import serializers as s
from apps.nodes.models import EmissionFactor, Node
from apps.slices.selectors import slices_by_card
from apps.tenants import policy

REGION_MAX = 64  # nodes.region's length


class AgentAuthCheckView(APIView):
    """Lets an installer or an agent check its key before doing anything else."""

    permission_classes = [IsAgent]

    @extend_schema(
        responses=inline_serializer(
            "AgentAuthCheck", {"ok": serializers.BooleanField(), "server_time": serializers.DateTimeField()}
        )
    )
    def get(self, request):
        return Response({"ok": True, "server_time": utcnow()})


class IsOperatorOrAgentForWrites(BasePermission):
    """Reads: people. The manual create (it can rewrite the IP the gateway forwards to):
    operators and agents only."""

    message = "Only platform operators and node agents can create or change nodes this way."

    def has_permission(self, request, view):
        principal = request.auth
        if principal is None:
            return False
        if request.method == "POST":
            return principal.is_operator or principal.is_agent
        return principal.is_operator or principal.is_tenant


def query(serializer_class, request):
    serializer = serializer_class(data=request.query_params.dict())
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class NodeView(ScopedAPIView):
    """One node by the id in its URL, among those the caller may see (404 otherwise)."""

    queryset = Node.objects.all()
    lookup_url_kwarg = "node_id"


class NodeListView(APIView):
    permission_classes = [IsOperatorOrAgentForWrites]

    @extend_schema(
        operation_id="v1_nodes_list",
        parameters=[s.NodeListQuerySerializer],
        responses=inline_serializer(
            "PaginatedNodeList",
            {
                "count": serializers.IntegerField(),
                "next": serializers.URLField(allow_null=True),
                "previous": serializers.URLField(allow_null=True),
                "results": s.NodeSerializer(many=True),
            },
        ),
    )
    def get(self, request):
        params = query(s.NodeListQuerySerializer, request)
        nodes = selectors.node_list(request.auth, q=params["q"], status=params["status"], gpu_type=params["gpu_type"])
        paginator = Pagination()
        limit, offset = paginator.window(request)
        paginator.count, page = presenters.present_page(nodes, ("name", "id"), limit=limit, offset=offset)
        return paginator.get_paginated_response(page)

    @extend_schema(request=s.NodeUpsertSerializer, responses={200: s.NodeSerializer, 201: s.NodeSerializer})
    def post(self, request):
        serializer = s.NodeUpsertSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        fields = dict(serializer.validated_data)
        node_id = fields.pop("id")
        node, created = services.upsert_node(node_id, fields)
        return Response(presenters.present_one(node), status=201 if created else 200)


class NodeDetailView(NodeView):
    @extend_schema(responses=s.NodeDetailSerializer)
    def get(self, request, node_id):
        node = self.get_object()
        data = presenters.present_one(node)
        by_card = slices_by_card(node, request.auth)
        for gpu in data["gpus"]:
            gpu["slices"] = by_card.get(gpu["index"], [])
        return Response(data)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "force",
                bool,
                description=(
                    "Also remove the models registered on the node: a model registered on this node only is deleted, "
                    "one registered elsewhere too loses this node. It never overrides the active-task check."
                ),
            )
        ],
        responses={
            200: inline_serializer(
                "NodeDeleted",
                {
                    "deleted": serializers.CharField(),
                    "deleted_models": serializers.ListField(
                        child=serializers.CharField(), help_text="tenant/name of the models deleted with the node"
                    ),
                    "unregistered_models": serializers.ListField(
                        child=serializers.CharField(),
                        help_text="tenant/name of the models that stay, registered on other nodes",
                    ),
                    "other_tenants_models": serializers.IntegerField(
                        help_text="models of tenants the caller cannot see among those, counted, not named"
                    ),
                },
            )
        },
    )
    def delete(self, request, node_id):
        node = self.get_object()
        policy.check_may_delete_node(request.auth, node)
        force = request.query_params.get("force", "false").lower() in ("1", "true", "yes")
        deleted = services.delete_node(node, force=force, principal=request.auth)
        return Response({"deleted": deleted.node_id, **deleted.cleared})


class NodeGpuView(NodeView):
    permission_classes = [IsOperator]

    @extend_schema(responses={204: None})
    def delete(self, request, node_id, index):
        services.forget_lost_gpu(self.get_object(), index)
        return Response(status=status.HTTP_204_NO_CONTENT)


class NodeLocationView(NodeView):
    permission_classes = [IsOperator]

    @extend_schema(request=s.LocationSerializer, responses=s.NodeSerializer)
    def put(self, request, node_id):
        node = self.get_object()
        serializer = s.LocationSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.set_location(node, {k: v.strip() for k, v in serializer.validated_data.items()})
        return Response(presenters.present_one(node))


class NodeTenantView(NodeView):
    permission_classes = [IsOperator]

    @extend_schema(
        request=s.TenantAssignmentSerializer,
        responses=inline_serializer(
            "TenantAssigned",
            {
                "node": s.NodeSerializer(),
                "mode": serializers.CharField(),
                "other_tenant_tasks": serializers.ListField(child=serializers.IntegerField()),
                "stopping": serializers.ListField(child=serializers.IntegerField()),
            },
        ),
    )
    def put(self, request, node_id):
        node = self.get_object()
        serializer = s.TenantAssignmentSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        tenant = None if data["tenant"] is None else policy.named_tenant(request.auth, data["tenant"])
        result = services.assign_tenant(node, tenant, expected_version=data["version"], mode=data["mode"])
        return Response(
            {
                "node": presenters.present_one(result.node),
                "mode": result.mode,
                "other_tenant_tasks": result.other_tenant_tasks,
                "stopping": result.stopping,
            }
        )


class NodeServiceView(NodeView):
    """POST /api/v1/admin/nodes/{id}/drain, /maintenance, /return: the admin's actions as
    API calls, through the same services (docs/nodes.md#out-of-service)."""

    permission_classes = [IsOperator]
    move = ""  # set by the URL configuration

    @extend_schema(
        request=s.ServiceMoveSerializer,
        responses=inline_serializer(
            "NodeServiceChanged",
            {
                "node": s.NodeSerializer(),
                "service": serializers.ChoiceField(
                    choices=["in_service", "drain", "maintenance"], help_text="The node's service state now."
                ),
                "requeued": serializers.ListField(
                    child=serializers.IntegerField(), help_text="maintenance: tasks sent back to the queue at once"
                ),
                "stopping": serializers.ListField(
                    child=serializers.IntegerField(),
                    help_text="maintenance: tasks their agent stops before they are queued again",
                ),
            },
        ),
    )
    def post(self, request, node_id):
        node = self.get_object()
        serializer = s.ServiceMoveSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        result = services.change_service(node, self.move, request.auth, reason=serializer.validated_data["reason"])
        return Response(
            {
                "node": presenters.present_one(result.node),
                "service": result.service,
                "requeued": result.requeued,
                "stopping": result.stopping,
            }
        )


class NodeMetricsView(NodeView):
    @extend_schema(
        parameters=[s.HoursSerializer],
        responses=inline_serializer(
            "NodeMetricsHistory",
            {
                "node_id": serializers.CharField(),
                "hours": serializers.IntegerField(),
                "bucket_seconds": serializers.IntegerField(),
                "points": serializers.ListField(child=serializers.DictField()),
            },
        ),
    )
    def get(self, request, node_id):
        node = self.get_object()
        return Response(metrics.history(node.pk, query(s.HoursSerializer, request)["hours"]))


class NodeEnergyView(NodeView):
    """The node's energy (docs/energy.md): the window's (`hours`), the long-lived
    accumulators, power per card, per node and the CPU estimate, the daily energy
    (`days`), and carbon under the factor and role rules. Null where nothing was
    measured, never 0."""

    @extend_schema(parameters=[s.EnergyQuerySerializer], responses=s.NodeEnergySerializer)
    def get(self, request, node_id):
        node = self.get_object()
        params = query(s.EnergyQuerySerializer, request)
        return Response(metrics.node_energy(node, request.auth, hours=params["hours"], days=params["days"]))


def energy_settings(node) -> dict:
    factor = carbon.factor_for(node)
    return {
        "node_id": node.pk,
        "emission_factor_g_per_kwh": node.emission_factor_g_per_kwh,
        "cpu_tdp_w": node.cpu_tdp_w,
        "cpu_tdp_w_model": node.cpu_tdp_w_model,
        "region": node.region,
        "factor_g_per_kwh": factor.g_per_kwh if factor else None,
        "factor_source": factor.source if factor else None,
    }


class NodeEnergySettingsView(NodeView):
    """PUT /api/v1/admin/nodes/{id}/energy: the node's own emission factor and CPU TDP
    (operators, as the location). Omitted = unchanged, null = cleared; a bad value is a
    400 and nothing is written."""

    permission_classes = [IsOperator]

    @extend_schema(responses=s.NodeEnergySettingsAnswerSerializer)
    def get(self, request, node_id):
        return Response(energy_settings(self.get_object()))

    @extend_schema(request=s.NodeEnergySettingsSerializer, responses=s.NodeEnergySettingsAnswerSerializer)
    def put(self, request, node_id):
        node = self.get_object()
        serializer = s.NodeEnergySettingsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        node = services.set_node_energy(node, dict(serializer.validated_data), request.auth)
        return Response(energy_settings(node))


def present_factor(factor: EmissionFactor) -> dict:
    return {
        "region": factor.region,
        "g_co2e_per_kwh": factor.g_co2e_per_kwh,
        "source": factor.source,
        "updated_at": factor.updated_at,
        "nodes": Node.objects.filter(region=factor.region, emission_factor_g_per_kwh__isnull=True).count(),
    }


class EmissionFactorListView(APIView):
    """The regions' emission factors (operators)."""

    permission_classes = [IsOperator]

    @extend_schema(responses=s.EmissionFactorSerializer(many=True))
    def get(self, request):
        return Response([present_factor(factor) for factor in EmissionFactor.objects.order_by("region")])


class EmissionFactorDetailView(APIView):
    """One region's factor: PUT creates or replaces it (201 / 200), DELETE removes it."""

    permission_classes = [IsOperator]

    def factor(self, region: str) -> EmissionFactor:
        found = EmissionFactor.objects.filter(region=region).first()
        if found is None:
            raise NotFound(f"No emission factor for region '{region}'.")
        return found

    @extend_schema(responses=s.EmissionFactorSerializer)
    def get(self, request, region):
        return Response(present_factor(self.factor(region)))

    @extend_schema(
        request=s.EmissionFactorWriteSerializer,
        responses={200: s.EmissionFactorSerializer, 201: s.EmissionFactorSerializer},
    )
    def put(self, request, region):
        if not region.strip() or len(region) > REGION_MAX or region != region.strip():
            raise ValidationError({"region": [f"A region is 1 to {REGION_MAX} characters, no surrounding spaces."]})
        serializer = s.EmissionFactorWriteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        factor, created = services.put_emission_factor(region, data["g_co2e_per_kwh"], data["source"], request.auth)
        return Response(present_factor(factor), status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(responses={204: None})
    def delete(self, request, region):
        services.delete_emission_factor(self.factor(region), request.auth)
        return Response(status=status.HTTP_204_NO_CONTENT)


class EnvironmentSummaryView(APIView):
    @extend_schema(
        responses=inline_serializer(
            "EnvironmentSummary",
            {
                "nodes": serializers.IntegerField(),
                "online_checkable": serializers.IntegerField(),
                "offline": serializers.IntegerField(),
                "by_status": serializers.DictField(child=serializers.IntegerField()),
                "gpus": serializers.IntegerField(),
                "gpus_lost": serializers.IntegerField(),
                "gpu_vendors": serializers.DictField(child=serializers.IntegerField()),
            },
        )
    )
    def get(self, request):
        return Response(selectors.environment_summary(request.auth))
