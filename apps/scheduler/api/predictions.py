"""How accurate the start-time estimates were (docs/predictions.md#accuracy): operators
only, read from the estimates each task kept beside its real start."""

from __future__ import annotations

from datetime import timedelta

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.clock import utcnow
from apps.core.permissions import IsOperator
from apps.core.serializers import StrictSerializer
from apps.scheduler import predictions

MAX_DAYS = 365


class AccuracyQuery(StrictSerializer):
    days = serializers.IntegerField(min_value=1, max_value=MAX_DAYS, default=30)
    min_wait_seconds = serializers.IntegerField(min_value=0, max_value=7 * 24 * 3600, default=600)


class ErrorSummary(serializers.Serializer):
    estimates = serializers.IntegerField()
    median_error_seconds = serializers.FloatField(allow_null=True, help_text="|p50 − real start|, median")
    p90_error_seconds = serializers.FloatField(allow_null=True)
    median_relative_error = serializers.FloatField(
        allow_null=True, help_text="the error divided by the wait that was left, median"
    )


class LeadBand(ErrorSummary):
    lead = serializers.CharField(help_text="how far ahead of the real start the estimate was made")
    from_seconds = serializers.IntegerField()
    to_seconds = serializers.IntegerField(allow_null=True)


class AtSubmission(ErrorSummary):
    min_wait_seconds = serializers.IntegerField()


class AccuracyReport(serializers.Serializer):
    since = serializers.DateTimeField()
    bands = LeadBand(many=True)
    at_submission = AtSubmission(help_text="each task's first estimate, for the tasks that waited that long")


class PredictionAccuracyView(APIView):
    """The median absolute error of the start-time estimates of the tasks that started in
    the last `days`, by how far ahead each estimate was made, and of the first estimates
    of the tasks that waited over `min_wait_seconds`."""

    permission_classes = [IsOperator]

    @extend_schema(
        parameters=[
            OpenApiParameter("days", int, description=f"the tasks that started in the last N days (1–{MAX_DAYS}, 30)"),
            OpenApiParameter("min_wait_seconds", int, description="at submission: only waits over this (600)"),
        ],
        responses=AccuracyReport,
    )
    def get(self, request):
        query = AccuracyQuery(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        since = utcnow() - timedelta(days=query.validated_data["days"])
        return Response(predictions.accuracy(since, query.validated_data["min_wait_seconds"]))
