from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.clock import utcnow
from apps.core.permissions import IsAgent


class AgentAuthCheckView(APIView):
    """Lets an installer or an agent check its key before doing anything else."""

    permission_classes = [IsAgent]

    @extend_schema(
        responses=inline_serializer("AgentAuthCheck", {"ok": serializers.BooleanField(), "server_time": serializers.DateTimeField()})
    )
    def get(self, request):
        return Response({"ok": True, "server_time": utcnow()})
