from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.error_codes import CoreErrorCode
from apps.core.errors import Conflict
from apps.core.permissions import IsAgent
from apps.core.views import ScopedAPIView
from apps.slices import services
from apps.slices.api import serializers as s
from apps.slices.choices import RequestStatus
from apps.slices.models import Slice, SliceRequest
from apps.slices.selectors import slice_list


class SliceListView(ScopedAPIView, generics.ListAPIView):
    """The caller's slices (an operator: all), newest first, paged; `?node_id=`,
    `?state=`, `?tier=`, `?task_id=` filter in SQL."""

    queryset = Slice.objects.all()
    serializer_class = s.SliceSerializer

    def get_queryset(self):
        return slice_list(super().get_queryset(), **self.params)

    @extend_schema(parameters=[s.SliceListQuerySerializer])
    def get(self, request, *args, **kwargs):
        serializer = s.SliceListQuerySerializer(data=request.query_params.dict())
        serializer.is_valid(raise_exception=True)
        self.params = {k: v for k, v in serializer.validated_data.items() if k not in ("limit", "offset")}
        return super().get(request, *args, **kwargs)


class SliceDetailView(ScopedAPIView):
    """One slice by id among the caller's (404 otherwise, another tenant's too)."""

    queryset = Slice.objects.select_related("tenant")

    @extend_schema(responses=s.SliceSerializer)
    def get(self, request, pk):
        return Response(s.SliceSerializer(self.get_object()).data)


class AgentSliceRequestListView(APIView):
    """The agent's poll: its node's requests in one status (pending), at most 5, oldest first."""

    permission_classes = [IsAgent]

    @extend_schema(parameters=[s.SliceRequestListQuerySerializer], responses=s.SliceRequestPageSerializer)
    def get(self, request):
        serializer = s.SliceRequestListQuerySerializer(data=request.query_params.dict())
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        requests = services.pending_for_node(data["node_id"], data["status"], data["limit"])
        return Response({"results": s.SliceRequestSerializer(requests, many=True).data})


class AgentSliceRequestDetailView(APIView):
    """The agent's claim (pending → processing) and report (processing → completed /
    failed), each a CAS from the status it saw: 409 when the request is not in it any
    more (timed out, or a retried report), saying its status; 404 for another node's."""

    permission_classes = [IsAgent]

    @extend_schema(request=s.SliceRequestUpdateSerializer, responses=s.SliceRequestSerializer)
    def put(self, request, pk):
        serializer = s.SliceRequestUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        slice_request = get_object_or_404(SliceRequest, pk=pk, node_id=data["node_id"])
        try:
            if data["status"] == RequestStatus.PROCESSING:
                slice_request = services.claim(slice_request)
            else:
                slice_request = services.report(
                    slice_request, status=data["status"], result=data.get("result", {}), error=data["error"]
                )
        except services.NotProcessing as exc:
            raise Conflict(
                f"Slice request {exc.request.pk} is {exc.request.status}, not {data['from_status']}; nothing changed.",
                CoreErrorCode.STATUS_CHANGED,
            ) from None
        return Response(s.SliceRequestSerializer(slice_request).data)
