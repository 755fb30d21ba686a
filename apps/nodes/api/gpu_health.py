"""The GPU health API (docs/gpu-health.md#the-api): the cards by risk, the per-model
failure statistics, the capability matrix and one card's history; and the operators'
cordon and uncordon of one card. Reads come from apps.nodes.gpu_health_selectors,
changes go through apps.nodes.gpu_health_services."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.pagination import PageQuerySerializer, Pagination
from apps.core.permissions import IsOperator
from apps.core.serializers import StrictSerializer
from apps.nodes import gpu_health_selectors as health
from apps.nodes import gpu_health_services, presenters
from apps.nodes.api.serializers import NodeSerializer
from apps.nodes.api.views import NodeView, query
from apps.nodes.choices import CordonSource, GpuState
from apps.nodes.health import COUNTERS, FLAGS
from apps.nodes.prediction import ESTIMATE, NOT_ENOUGH_DATA

PREDICTION_STATUSES = [
    (ESTIMATE, "the model's empirical fraction (enough cards with corrected errors)"),
    (NOT_ENOUGH_DATA, "too few cards of the model with corrected errors: no percentage"),
    ("not_applicable", "the card shows no corrected errors: the prediction is about cards that do"),
    ("no_data", "the card never reported health"),
]


class CardPredictionSerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=PREDICTION_STATUSES)
    failure_fraction = serializers.FloatField(
        allow_null=True, help_text="Of the model's cards seen with corrected errors, the fraction later unhealthy."
    )
    interval = serializers.ListField(
        child=serializers.FloatField(), allow_null=True, help_text="The 95% Wilson interval [low, high]."
    )
    cards_with_corrected = serializers.IntegerField()
    became_unhealthy = serializers.IntegerField()


class EvidenceSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()


class CardHealthSerializer(serializers.Serializer):
    """A card on the health list (built by gpu_health_selectors.present_card)."""

    node_id = serializers.CharField()
    node_name = serializers.CharField()
    index = serializers.IntegerField()
    uuid = serializers.CharField()
    vendor = serializers.CharField()
    model = serializers.CharField()
    state = serializers.ChoiceField(choices=GpuState.choices)
    risk = serializers.ChoiceField(choices=list(health.RISK_NAMES.values()))
    cordoned = serializers.BooleanField()
    cordon_source = serializers.ChoiceField(choices=CordonSource.choices, allow_null=True)
    cordon_reason = serializers.CharField(allow_null=True)
    cordoned_at = serializers.DateTimeField(allow_null=True)
    cordon_evidence = serializers.DictField(
        allow_null=True, help_text="health: first_at, latest_at and the reasons; operator: by and at."
    )
    last_bad_at = serializers.DateTimeField(allow_null=True)
    health_at = serializers.DateTimeField(allow_null=True)
    health = serializers.DictField(allow_null=True, help_text="The card's latest reading as the agent sent it.")
    evidence = EvidenceSerializer(many=True)
    prediction = CardPredictionSerializer()


class GpuHealthListQuerySerializer(PageQuerySerializer):
    risk = serializers.ChoiceField(
        choices=list(health.RISK_NAMES.values()), required=False, allow_blank=True, default=""
    )
    model = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class ModelStatisticsSerializer(serializers.Serializer):
    model = serializers.CharField()
    vendor = serializers.CharField()
    cards_observed = serializers.IntegerField()
    cards_with_corrected = serializers.IntegerField()
    became_unhealthy = serializers.IntegerField()
    min_cards = serializers.IntegerField()
    status = serializers.ChoiceField(choices=[ESTIMATE, NOT_ENOUGH_DATA])
    failure_fraction = serializers.FloatField(allow_null=True)
    interval_low = serializers.FloatField(allow_null=True)
    interval_high = serializers.FloatField(allow_null=True)


# One sample of a card's history (gpu_health_selectors.present_sample): the reading's
# counters and flags (null: not read), what was new, and the judgement.
SampleSerializer = type(
    "SampleSerializer",
    (serializers.Serializer,),
    {
        "at": serializers.DateTimeField(),
        **{name: serializers.IntegerField(allow_null=True) for name in COUNTERS},
        **{name: serializers.BooleanField(allow_null=True) for name in FLAGS},
        "xid_events": serializers.ListField(child=serializers.DictField(), help_text="The events new in this sample."),
        "throttle_reasons": serializers.ListField(child=serializers.CharField(), allow_null=True),
        "available": serializers.ListField(child=serializers.CharField()),
        "unhealthy": serializers.BooleanField(),
        "reasons": serializers.ListField(child=serializers.DictField(), help_text="The judgement's evidence."),
    },
)


class CordonSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=300, help_text="Why the card is cordoned; kept on the card.")


class UncordonSerializer(StrictSerializer):
    """Nothing, or the operator's note for the audit record."""

    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")


class GpuHealthListView(APIView):
    """GET /api/v1/gpu-health: the visible cards, riskiest first."""

    @extend_schema(
        operation_id="v1_gpu_health_list",
        parameters=[GpuHealthListQuerySerializer],
        responses=inline_serializer(
            "PaginatedCardHealthList",
            {
                "count": serializers.IntegerField(),
                "next": serializers.URLField(allow_null=True),
                "previous": serializers.URLField(allow_null=True),
                "results": CardHealthSerializer(many=True),
            },
        ),
    )
    def get(self, request):
        params = query(GpuHealthListQuerySerializer, request)
        paginator = Pagination()
        page = paginator.paginate_queryset(
            health.cards_by_risk(request.auth, risk=params["risk"], model=params["model"]), request, view=self
        )
        stats = health.statistics_by_model(request.auth)
        return paginator.get_paginated_response([health.present_card(gpu, stats) for gpu in page])


class GpuHealthPredictionsView(APIView):
    """GET /api/v1/gpu-health/predictions: per GPU model, from the ECC history."""

    @extend_schema(
        responses=inline_serializer(
            "GpuHealthPredictions",
            {
                "min_cards": serializers.IntegerField(),
                "caveat": serializers.CharField(),
                "models": ModelStatisticsSerializer(many=True),
            },
        )
    )
    def get(self, request):
        stats = health.statistics_by_model(request.auth)
        return Response(
            {
                "min_cards": health.prediction_min_cards(),
                "caveat": health.PREDICTION_CAVEAT,
                "models": [stats[model].as_dict() for model in sorted(stats)],
            }
        )


class GpuHealthCapabilitiesView(APIView):
    """GET /api/v1/gpu-health/capabilities: what each vendor's agents can read."""

    @extend_schema(
        responses=inline_serializer(
            "GpuHealthCapabilities",
            {
                "fields": serializers.ListField(child=serializers.CharField()),
                "vendors": serializers.ListField(
                    child=inline_serializer(
                        "VendorHealthCapability",
                        {
                            "vendor": serializers.CharField(),
                            "label": serializers.CharField(),
                            "cards": serializers.IntegerField(),
                            "reporting_cards": serializers.IntegerField(),
                            "status": serializers.ChoiceField(choices=["reports", "no_reporting_card", "no_cards"]),
                            "fields": serializers.DictField(
                                child=serializers.IntegerField(),
                                allow_null=True,
                                help_text="Per field, the reporting cards that declared it; null: none reports.",
                            ),
                        },
                    )
                ),
            },
        )
    )
    def get(self, request):
        return Response(health.capability_matrix(request.auth))


class CardHealthView(NodeView):
    """GET /api/v1/nodes/{id}/gpus/{index}/health: the card now and its history, newest first."""

    @extend_schema(
        parameters=[PageQuerySerializer],
        responses=inline_serializer(
            "CardHealthHistory",
            {
                "card": CardHealthSerializer(),
                "count": serializers.IntegerField(),
                "next": serializers.URLField(allow_null=True),
                "previous": serializers.URLField(allow_null=True),
                "results": SampleSerializer(many=True),
            },
        ),
    )
    def get(self, request, node_id, index):
        node = self.get_object()
        gpu = health.card_or_404(node, index)
        paginator = Pagination()
        page = paginator.paginate_queryset(health.card_samples(node, index), request, view=self)
        response = paginator.get_paginated_response([health.present_sample(sample) for sample in page])
        response.data = {"card": health.present_card(gpu, health.statistics_by_model(request.auth))} | response.data
        return response


class CardCordonView(NodeView):
    """POST /api/v1/admin/nodes/{id}/gpus/{index}/cordon (operators): no new placement on
    the card; the tasks on it run on. 404: no such node or card; 409: already cordoned;
    400: no reason. Nothing is written on a refusal."""

    permission_classes = [IsOperator]

    def answer(self, request, node):
        gpu = health.card_or_404(node, self.kwargs["index"])
        stats = health.statistics_by_model(request.auth)
        return Response({"node": presenters.present_one(node), "card": health.present_card(gpu, stats)})

    @extend_schema(
        request=CordonSerializer,
        responses=inline_serializer("CardCordonChanged", {"node": NodeSerializer(), "card": CardHealthSerializer()}),
    )
    def post(self, request, node_id, index):
        node = self.get_object()
        serializer = CordonSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        gpu_health_services.cordon_card(node, index, serializer.validated_data["reason"], request.auth)
        return self.answer(request, node)


class CardUncordonView(CardCordonView):
    """POST /api/v1/admin/nodes/{id}/gpus/{index}/uncordon (operators): the card takes
    placements again, whoever cordoned it; its GPU_UNHEALTHY alert recovers. 404: no such
    node or card; 409: not cordoned."""

    @extend_schema(
        request=UncordonSerializer,
        responses=inline_serializer("CardUncordoned", {"node": NodeSerializer(), "card": CardHealthSerializer()}),
    )
    def post(self, request, node_id, index):
        node = self.get_object()
        serializer = UncordonSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        gpu_health_services.uncordon_card(node, index, request.auth, note=serializer.validated_data["reason"])
        return self.answer(request, node)
