"""GET /api/v1/schemas/jobs: the job file's JSON Schema (apps.core.jobs_schema), for `hf`
and the SDK. Public, like the OpenAPI schema: it describes the API and holds no data
(credentials are still checked when sent: a wrong key is 401, as everywhere). Answered
with an ETag; If-None-Match with it is 304."""

from __future__ import annotations

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.views import APIView

from apps.core import jobs_schema
from apps.inference.api.serializers import ServiceCreateSerializer
from apps.tasks.api.serializers import ENV_NAME, TaskArraySerializer, TaskGroupCreateSerializer

SOURCES = jobs_schema.Sources(
    task=TaskArraySerializer,  # a task body, with the optional `array` of POST /tasks/batch
    group=TaskGroupCreateSerializer,
    service=ServiceCreateSerializer,
    env_name=ENV_NAME.pattern,
)


class JobsSchemaView(APIView):
    permission_classes = [AllowAny]

    @extend_schema(
        responses={
            200: OpenApiResponse(OpenApiTypes.OBJECT, description="A JSON Schema (draft 2020-12)"),
            304: OpenApiResponse(description="Not modified: the If-None-Match ETag is current"),
        },
        description="The JSON Schema of a job file's document (kind: task, group or service), for hf and the SDK.",
    )
    def get(self, request):
        published = jobs_schema.published(SOURCES)
        if published.etag in request.headers.get("If-None-Match", ""):
            response = HttpResponse(status=304)
        else:
            response = HttpResponse(published.body, content_type="application/json")
        response["ETag"] = published.etag
        response["Cache-Control"] = "no-cache"
        return response
