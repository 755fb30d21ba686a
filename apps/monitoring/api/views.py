from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.permissions import IsOperator
from apps.monitoring import checks, diagnostics, selectors
from apps.monitoring.api import serializers as s


class ServerMetricsView(APIView):
    """This control-plane host now (CPU over the time since the previous call, up to 1 s)."""

    permission_classes = [IsOperator]

    @extend_schema(responses=s.LiveMetricsSerializer)
    def get(self, request):
        return Response(selectors.live())


class ServerMetricsHistoryView(APIView):
    permission_classes = [IsOperator]

    @extend_schema(parameters=[s.HistoryQuerySerializer], responses=s.HistorySerializer)
    def get(self, request):
        query = s.HistoryQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        return Response(selectors.history(query.validated_data["hours"], host=query.validated_data["host"]))


class ServerHealthCheckView(APIView):
    permission_classes = [IsOperator]

    @extend_schema(responses=s.HealthCheckSerializer)
    def get(self, request):
        return Response(checks.run_all())


class ServerRuntimeView(APIView):
    """Runtime internals of the process that answers."""

    permission_classes = [IsOperator]

    @extend_schema(responses=s.RuntimeSerializer)
    def get(self, request):
        return Response(diagnostics.runtime_facts())


class HealthDetailView(APIView):
    """The status bar's health: GPUs of the nodes you may see, your own tasks."""

    @extend_schema(responses=s.HealthDetailSerializer)
    def get(self, request):
        return Response(selectors.health_detail_for(request.auth))
