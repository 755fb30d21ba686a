"""Replays operators ask for (docs/simulate.md#from-the-api-hf-and-the-portal): POST a
request, follow its progress, read its report and charts."""

from __future__ import annotations

import base64

from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.permissions import IsOperator
from apps.core.serializers import StrictSerializer
from apps.scheduler import simulate, simulations, traces
from apps.scheduler.models import Simulation

LISTED = 50


class GenerateSerializer(StrictSerializer):
    jobs = serializers.IntegerField(min_value=1, max_value=200_000)
    days = serializers.FloatField(min_value=0.01, max_value=31, default=2.0)
    tenants = serializers.IntegerField(min_value=1, max_value=100, default=4)
    seed = serializers.IntegerField(min_value=0, max_value=2**31, default=1)


class WorkSerializer(StrictSerializer):
    """Exactly one of: this cluster's history, a generated trace, trace rows."""

    from_history_days = serializers.FloatField(min_value=0.01, max_value=90, required=False)
    generate = GenerateSerializer(required=False)
    trace = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        max_length=simulations.MAX_TRACE_ROWS,
        help_text="rows of submit, gpus, duration and optionally tenant, gpu_type, priority, workers, declared",
    )

    def validate(self, attrs):
        if len(attrs) != 1:
            raise ValidationError("Give exactly one of from_history_days, generate and trace.")
        return attrs


class SimulationRequestSerializer(StrictSerializer):
    work = WorkSerializer()
    fleet = serializers.DictField(
        required=False, allow_null=True, default=None, help_text="{nodes: [...]} as a fleet file; null: this cluster"
    )
    policies = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        default=list,
        max_length=simulations.MAX_POLICIES,
        help_text="policies as policy files give them, run side by side; none: this cluster's",
    )


class SimulationSerializer(serializers.ModelSerializer):
    charts = serializers.SerializerMethodField()
    created_by = serializers.StringRelatedField()

    class Meta:
        model = Simulation
        fields = [
            "id",
            "state",
            "progress",
            "request",
            "report",
            "charts",
            "error",
            "created_by",
            "created_at",
            "started_at",
            "finished_at",
        ]

    def get_charts(self, simulation) -> list[str]:
        return [f"/api/v1/admin/simulations/{simulation.pk}/charts/{name}.png" for name in sorted(simulation.charts)]


class SimulationRow(SimulationSerializer):
    class Meta(SimulationSerializer.Meta):
        fields = ["id", "state", "progress", "error", "created_by", "created_at", "finished_at"]


class SimulationList(serializers.Serializer):
    results = SimulationRow(many=True, help_text=f"the latest {LISTED}")


class SimulationListView(APIView):
    """The latest replays, and a new one: POST a request (202), follow GET …/{id}."""

    permission_classes = [IsOperator]

    @extend_schema(operation_id="admin_simulations_list", responses=SimulationList)
    def get(self, request):
        rows = Simulation.objects.select_related("created_by")[:LISTED]
        return Response({"results": SimulationRow(rows, many=True).data})

    @extend_schema(request=SimulationRequestSerializer, responses={202: SimulationSerializer})
    def post(self, request):
        body = SimulationRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            simulation = simulations.request_simulation(request.auth.user, body.validated_data)
        except (simulate.SimulationInputError, traces.TraceError) as exc:
            raise ValidationError({"request": [str(exc)]}) from None
        return Response(SimulationSerializer(simulation).data, status=status.HTTP_202_ACCEPTED)


class SimulationView(APIView):
    """One replay: its state and progress, and once done its report and charts' URLs."""

    permission_classes = [IsOperator]

    @extend_schema(responses=SimulationSerializer)
    def get(self, request, pk):
        return Response(SimulationSerializer(find(pk)).data)


class SimulationChartView(APIView):
    """A chart of a finished replay, as PNG."""

    permission_classes = [IsOperator]

    @extend_schema(responses={(200, "image/png"): bytes})
    def get(self, request, pk, name):
        png = find(pk).charts.get(name)
        if png is None:
            raise NotFound(f"No chart {name!r} for simulation {pk}.")
        return HttpResponse(base64.b64decode(png), content_type="image/png")


def find(pk: int) -> Simulation:
    simulation = Simulation.objects.filter(pk=pk).first()
    if simulation is None:
        raise NotFound(f"No simulation {pk}.")
    return simulation
