from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.permissions import IsOperator
from apps.core.serializers import StrictSerializer
from apps.scheduler import services
from apps.scheduler.core import TaskReq, place
from apps.tenants import policy


class PluginRow(serializers.Serializer):
    name = serializers.CharField()
    kind = serializers.CharField()
    enabled = serializers.BooleanField()
    locked = serializers.BooleanField(help_text="Correctness plugins are always on.")
    weight = serializers.FloatField()
    extra = serializers.DictField()


class PluginOptionsSerializer(StrictSerializer):
    weight = serializers.FloatField(min_value=0, max_value=100, required=False)
    extra = serializers.DictField(required=False)


def known(name: str) -> str:
    if name not in services.PLUGINS:
        raise NotFound(f"No scheduler plugin '{name}'.")
    return name


class PluginListView(APIView):
    permission_classes = [IsOperator]

    @extend_schema(responses=PluginRow(many=True))
    def get(self, request):
        return Response(services.plugin_table())


class PluginView(APIView):
    permission_classes = [IsOperator]

    @extend_schema(
        parameters=[OpenApiParameter("action", str, enum=["enable", "disable"], required=True)],
        request=None,
        responses=PluginRow(many=True),
    )
    def post(self, request, name):
        action = request.query_params.get("action")
        if action not in ("enable", "disable"):
            raise ValidationError({"action": ["Use ?action=enable or ?action=disable."]})
        services.set_plugin_enabled(known(name), action == "enable")
        return Response(services.plugin_table())

    @extend_schema(request=PluginOptionsSerializer, responses=PluginRow(many=True))
    def put(self, request, name):
        serializer = PluginOptionsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.set_plugin_options(known(name), **serializer.validated_data)
        return Response(services.plugin_table())


class DryRunSerializer(StrictSerializer):
    tenant = serializers.CharField(required=False, help_text="Tenant slug; operators only, defaults to yours.")
    gpu_required = serializers.IntegerField(min_value=0, max_value=64, default=1)
    gpu_memory_mb = serializers.IntegerField(min_value=1, required=False, allow_null=True, default=None)
    gpu_type = serializers.CharField(max_length=20, required=False, allow_blank=True, default="")
    priority = serializers.IntegerField(min_value=0, max_value=100, default=50)
    labels = serializers.DictField(
        child=serializers.CharField(max_length=1024, allow_blank=True), required=False, default=dict
    )


class DryRunAnswer(serializers.Serializer):
    placed = serializers.BooleanField()
    node_id = serializers.CharField(allow_null=True)
    gpu_indices = serializers.ListField(child=serializers.IntegerField())
    score = serializers.FloatField(allow_null=True)
    reason = serializers.DictField(allow_null=True)


class DryRunView(APIView):
    """Where a described task would go now, and why; binds nothing."""

    @extend_schema(request=DryRunSerializer, responses=DryRunAnswer)
    def post(self, request):
        serializer = DryRunSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        tenant = policy.acting_tenant(
            request.auth, data.pop("tenant", None), required="Required: the slug of the tenant the task would run for."
        )
        request_ = TaskReq(id=0, tenant_id=tenant.pk, **data)
        decisions, failures = place(
            [request_], services.load_nodes(), services.plugin_settings(), services.sharing_rule()
        )
        if decisions:
            decision = decisions[0]
            return Response(
                {
                    "placed": True,
                    "node_id": decision.node_id,
                    "gpu_indices": decision.gpu_indices,
                    "score": decision.score,
                    "reason": None,
                }
            )
        return Response(
            {"placed": False, "node_id": None, "gpu_indices": [], "score": None, "reason": failures[0].as_reason()}
        )
