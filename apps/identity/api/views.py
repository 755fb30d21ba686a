"""The mapping table's API (operators only). Views decode and call services."""

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.permissions import IsOperator
from apps.identity import services
from apps.identity.api import serializers as s
from apps.identity.models import GroupMapping


class MappingTableView(APIView):
    """The directory groups that give a tenant and a role, or platform operator
    (docs/identity.md#mapping). PUT replaces the whole table; the next sign-in of each
    person applies it."""

    permission_classes = [IsOperator]

    @extend_schema(responses=s.MappingTableSerializer)
    def get(self, request):
        rows = GroupMapping.objects.select_related("tenant").order_by("group", "tenant__name")
        return Response({"mappings": s.MappingSerializer(rows, many=True).data})

    @extend_schema(request=s.MappingTableSerializer, responses=s.MappingTableSerializer)
    def put(self, request):
        table = s.MappingTableSerializer(data=request.data)
        table.is_valid(raise_exception=True)
        rows = services.replace_mappings(table.validated_data["mappings"], principal=request.auth)
        return Response({"mappings": s.MappingSerializer(rows, many=True).data})
