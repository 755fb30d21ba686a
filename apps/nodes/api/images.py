"""The image channel's API (docs/images.md): operators ask a live node to pull or check
images and read the requests; the node's agent fetches its pending requests and reports
on them (claim, progress, final) as it does for tasks; operators keep the watched list.
The shapes are those of agent/heteroflow_agent/protocol/image_channel.schema.json."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import generics, serializers, status
from rest_framework.permissions import BasePermission
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.cas import IllegalTransition, check_transition
from apps.core.error_codes import CoreErrorCode
from apps.core.errors import Conflict
from apps.core.pagination import PageQuerySerializer
from apps.core.permissions import IsAgent, IsOperator
from apps.core.serializers import AgentPayloadSerializer, StrictModelSerializer, StrictSerializer
from apps.nodes import images
from apps.nodes.api.views import NodeView
from apps.nodes.choices import (
    IMAGE_CHECK_MAX_REFERENCES,
    IMAGE_REQUEST_TRANSITIONS,
    GpuVendor,
    ImageRequestStatus,
    WatchedImageKind,
)
from apps.nodes.error_codes import NodeErrorCode
from apps.nodes.images_protocol import definition_errors, reference_error
from apps.nodes.models import ImageRequest, Node, WatchedImage

IRS = ImageRequestStatus


def requested_by(principal) -> str:
    name = getattr(principal.user, "username", "") or "operator"
    if principal.api_key is not None:
        return f"{name} (key {principal.api_key.display_prefix}…)"
    return name


# --- serializers ------------------------------------------------------------------------------


class ReferenceField(serializers.CharField):
    """An image reference in the docker reference grammar."""

    def __init__(self, **kwargs):
        super().__init__(max_length=512, trim_whitespace=False, **kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise serializers.ValidationError("An image reference is a string.")
        value = super().to_internal_value(data)
        problem = reference_error(value)
        if problem:
            raise serializers.ValidationError(problem)
        return value


class ImageRequestSerializer(serializers.ModelSerializer):
    """An image request as the API answers it (operators and the agent alike)."""

    node_id = serializers.CharField(read_only=True)
    references = serializers.ListField(child=serializers.CharField(), read_only=True)
    progress = serializers.JSONField(
        read_only=True, help_text="{layers_done, layers_total, bytes_done, bytes_total, message}; {} before the first"
    )
    result = serializers.JSONField(
        read_only=True, help_text="{images: [CHECK_ITEM …]} once finished; each item's reference as asked"
    )

    class Meta:
        model = ImageRequest
        fields = [
            "id",
            "node_id",
            "action",
            "references",
            "status",
            "progress",
            "progress_at",
            "result",
            "error",
            "requested_by",
            "created_at",
            "claimed_at",
            "deadline",
            "finished_at",
        ]
        read_only_fields = fields


class PullSerializer(StrictSerializer):
    reference = ReferenceField(
        help_text="repo/x:1.0 or repo/x@sha256:… (exact), or a bare repo/x (pulled as :latest); a registry may lead"
    )


class CheckSerializer(StrictSerializer):
    references = serializers.ListField(
        child=ReferenceField(),
        min_length=1,
        max_length=IMAGE_CHECK_MAX_REFERENCES,
        help_text="exact (tag or digest) or a bare repository (every local tag, with its size)",
    )


class ImageRequestListQuerySerializer(PageQuerySerializer):
    node_id = serializers.CharField(max_length=128, required=False)
    status = serializers.ChoiceField(choices=IRS.choices, required=False)


class AgentListQuerySerializer(StrictSerializer):
    node_id = serializers.CharField(max_length=128)
    status = serializers.ChoiceField(choices=IRS.choices)


class AgentImageReportSerializer(AgentPayloadSerializer):
    """The agent's report: claim {from_status: pending, status: processing}, progress
    {processing → processing, progress}, final {processing → completed | failed, result,
    error}. Read tolerantly at the top (a newer agent's field is ignored and named), the
    progress and result strictly by the schema."""

    channel = "image_report"

    node_id = serializers.CharField(max_length=128)
    from_status = serializers.ChoiceField(choices=IRS.choices)
    status = serializers.ChoiceField(choices=IRS.choices)
    progress = serializers.JSONField(
        required=False, help_text="layers_done, layers_total, bytes_done, bytes_total, message"
    )
    result = serializers.JSONField(required=False, help_text="{images: [CHECK_ITEM …]}")
    # the schema says 4,000 characters; a longer one is kept to that, not refused (a
    # refused final report would leave the request processing until the janitor's verdict)
    error = serializers.CharField(
        required=False, allow_blank=True, default="", max_length=64 * 1024, trim_whitespace=False
    )

    def validate(self, data):
        errors = {}
        progress = data["from_status"] == IRS.PROCESSING and data["status"] == IRS.PROCESSING
        if not progress:  # a progress report keeps the status: no transition
            try:
                check_transition(IMAGE_REQUEST_TRANSITIONS, [data["from_status"]], data["status"])
            except IllegalTransition as exc:
                errors["status"] = [str(exc)]
        if data["from_status"] == IRS.PENDING and data["status"] == IRS.FAILED:
            errors["status"] = ["The agent claims a request before it fails it (pending → failed is the janitor's)."]
        if "progress" in data:
            errors |= definition_errors("progress", data["progress"], "progress")
        if "result" in data:
            errors |= definition_errors("result", data["result"], "result")
        if progress and "progress" not in data:
            errors["progress"] = ["A progress report carries its progress."]
        if data["status"] == IRS.COMPLETED and "result" not in data:
            errors["result"] = ["A completed report carries its result."]
        if data["status"] == IRS.FAILED and not data["error"].strip():
            errors["error"] = ["A failed report says why."]
        if errors:
            raise serializers.ValidationError(errors)
        return data


class WatchedImageSerializer(StrictModelSerializer):
    vendor = serializers.CharField(
        max_length=20,
        required=False,
        default="",
        allow_blank=True,
        help_text="a GPU vendor (gpu_type); '': every vendor",
    )
    reference = ReferenceField()
    kind = serializers.ChoiceField(choices=WatchedImageKind.choices)
    note = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")

    class Meta:
        model = WatchedImage
        fields = ["id", "vendor", "reference", "kind", "note", "created_at", "updated_at"]
        read_only_fields = ["id", "created_at", "updated_at"]
        validators = []  # the unique pair is answered 409 by the view, not 400

    def validate_vendor(self, value):
        if value and value not in GpuVendor.values:
            raise serializers.ValidationError(f"Not a GPU vendor: one of {', '.join(GpuVendor.values)}, or '' for all.")
        return value

    def validate(self, data):
        duplicate = WatchedImage.objects.filter(vendor=data.get("vendor", ""), reference=data["reference"])
        if self.instance is not None:
            duplicate = duplicate.exclude(pk=self.instance.pk)
        if duplicate.exists():
            raise Conflict(f"'{data['reference']}' is watched for this vendor already.", NodeErrorCode.ALREADY_WATCHED)
        return data


WatchedListSerializer = inline_serializer(
    "NodeWatchedImages",
    {
        "node_id": serializers.CharField(),
        "vendor": serializers.CharField(help_text="the node's GPU vendor; '' for a node without GPUs"),
        "images": inline_serializer(
            "WatchedImageItem",
            {"reference": serializers.CharField(), "kind": serializers.CharField(), "note": serializers.CharField()},
            many=True,
        ),
    },
)


# --- operators --------------------------------------------------------------------------------


class NodeImagePullView(NodeView):
    permission_classes = [IsOperator]

    @extend_schema(request=PullSerializer, responses={202: ImageRequestSerializer})
    def post(self, request, node_id):
        """Ask the node's agent to pull one image in the background (2-hour budget,
        progress every minute). 409 node_offline for a node that is not online: no
        request is made. A pull of the same reference still open is answered again."""
        node = self.get_object()
        serializer = PullSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        made = images.request_pull(
            node, serializer.validated_data["reference"], requested_by=requested_by(request.auth)
        )
        return Response(ImageRequestSerializer(made).data, status=status.HTTP_202_ACCEPTED)


class NodeImageCheckView(NodeView):
    permission_classes = [IsOperator]

    @extend_schema(request=CheckSerializer, responses={202: ImageRequestSerializer})
    def post(self, request, node_id):
        """Ask the node's agent whether it has these images (at most 32): present, size,
        image id. 409 node_offline for a node that is not online."""
        node = self.get_object()
        serializer = CheckSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        made = images.request_check(
            node, serializer.validated_data["references"], requested_by=requested_by(request.auth)
        )
        return Response(ImageRequestSerializer(made).data, status=status.HTTP_202_ACCEPTED)


class OperatorOrAgent(BasePermission):
    message = "Only platform operators and node agents can read a node's watched images."

    def has_permission(self, request, view):
        principal = request.auth
        return principal is not None and (principal.is_operator or principal.is_agent)


class NodeWatchedImagesView(NodeView):
    permission_classes = [OperatorOrAgent]

    @extend_schema(responses=WatchedListSerializer)
    def get(self, request, node_id):
        """The images this node should have: its GPU vendor's engine images and every
        vendor's base and training images (the server's list; operators edit it)."""
        if request.auth.is_agent:  # the agent sees no node through the scope; it names its own
            node = get_object_or_404(Node, pk=node_id)
        else:
            node = self.get_object()
        rows = images.watched_images(node)
        return Response(
            {
                "node_id": node.pk,
                "vendor": node.gpu_type,
                "images": [{"reference": w.reference, "kind": w.kind, "note": w.note} for w in rows],
            }
        )


class ImageRequestListView(generics.ListAPIView):
    permission_classes = [IsOperator]
    serializer_class = ImageRequestSerializer

    def get_queryset(self):
        rows = ImageRequest.objects.all().order_by("-id")
        for name in ("node_id", "status"):
            if name in self.params:
                rows = rows.filter(**{name: self.params[name]})
        return rows

    @extend_schema(parameters=[ImageRequestListQuerySerializer])
    def get(self, request, *args, **kwargs):
        serializer = ImageRequestListQuerySerializer(data=request.query_params.dict())
        serializer.is_valid(raise_exception=True)
        self.params = serializer.validated_data
        return super().get(request, *args, **kwargs)


class ImageRequestDetailView(APIView):
    permission_classes = [IsOperator]

    @extend_schema(responses=ImageRequestSerializer)
    def get(self, request, pk):
        return Response(ImageRequestSerializer(get_object_or_404(ImageRequest, pk=pk)).data)


class WatchedImageListView(generics.ListAPIView):
    permission_classes = [IsOperator]
    serializer_class = WatchedImageSerializer
    queryset = WatchedImage.objects.all()

    @extend_schema(parameters=[PageQuerySerializer])
    def get(self, request, *args, **kwargs):
        PageQuerySerializer(data=request.query_params.dict()).is_valid(raise_exception=True)
        return super().get(request, *args, **kwargs)

    @extend_schema(request=WatchedImageSerializer, responses={201: WatchedImageSerializer})
    def post(self, request):
        serializer = WatchedImageSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        serializer.save()
        return Response(serializer.data, status=status.HTTP_201_CREATED)


class WatchedImageDetailView(APIView):
    permission_classes = [IsOperator]

    @extend_schema(responses=WatchedImageSerializer)
    def get(self, request, pk):
        return Response(WatchedImageSerializer(get_object_or_404(WatchedImage, pk=pk)).data)

    @extend_schema(request=WatchedImageSerializer, responses=WatchedImageSerializer)
    def put(self, request, pk):
        watched = get_object_or_404(WatchedImage, pk=pk)
        serializer = WatchedImageSerializer(watched, data=request.data)
        serializer.is_valid(raise_exception=True)
        serializer.save()
        return Response(serializer.data)

    @extend_schema(responses={204: None})
    def delete(self, request, pk):
        get_object_or_404(WatchedImage, pk=pk).delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- the agent --------------------------------------------------------------------------------


class AgentImageRequestListView(APIView):
    permission_classes = [IsAgent]

    @extend_schema(
        parameters=[AgentListQuerySerializer],
        responses=inline_serializer("AgentImageRequests", {"results": ImageRequestSerializer(many=True)}),
    )
    def get(self, request):
        """The node's requests in a status (pending: what to do next), at most 5, oldest first."""
        serializer = AgentListQuerySerializer(data=request.query_params.dict())
        serializer.is_valid(raise_exception=True)
        params = serializer.validated_data
        rows = images.agent_requests(params["node_id"], params["status"])
        return Response({"results": ImageRequestSerializer(rows, many=True).data})


class AgentImageRequestView(APIView):
    permission_classes = [IsAgent]

    @extend_schema(
        request=AgentImageReportSerializer,
        responses=ImageRequestSerializer,
    )
    def put(self, request, pk):
        """The agent's report, a compare-and-set from the status it saw: 409 when it lost
        (the janitor closed the request meanwhile, or it was claimed already). A request
        of another node is 404. A completed pull whose image is not in its check is
        stored failed ("pulled but not there"), answered 200 with that status."""
        serializer = AgentImageReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        row = get_object_or_404(ImageRequest, pk=pk, node_id=data["node_id"])
        report = images.Report(
            from_status=data["from_status"],
            status=data["status"],
            progress=data.get("progress"),
            result=data.get("result"),
            error=data["error"],
        )
        if not images.apply_report(row, report):
            row.refresh_from_db()
            raise Conflict(
                f"Image request {row.pk} is {row.status}, not {data['from_status']}; nothing changed.",
                CoreErrorCode.STATUS_CHANGED,
            )
        row.refresh_from_db()
        return Response(ImageRequestSerializer(row).data)
