from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.permissions import IsOperator
from apps.core.serializers import StrictSerializer
from apps.scheduler import services

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
        request=None, responses=PluginRow(many=True),
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
