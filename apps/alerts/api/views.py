"""The alerts API. What a caller sees is Alert.objects.visible_to: operators every alert,
a tenant's people their own task and tenant alerts, never node or GPU alerts."""

from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.alerts import selectors, services
from apps.alerts.api import serializers as s
from apps.alerts.error_codes import AlertErrorCode
from apps.alerts.models import Alert
from apps.core.errors import Conflict
from apps.core.pagination import PAGE_PARAMS
from apps.core.views import ScopedAPIView
from apps.tenants import policy


class AlertListView(generics.ListAPIView):
    serializer_class = s.AlertSerializer

    @extend_schema(parameters=[s.AlertListQuerySerializer])
    def get(self, request, *args, **kwargs):
        query = s.AlertListQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        self.filters = {k: v for k, v in query.validated_data.items() if k not in PAGE_PARAMS}
        return super().get(request, *args, **kwargs)

    def get_queryset(self):
        return selectors.alert_list(self.request.auth, **self.filters).select_related(
            "tenant", "acknowledged_by", "resolved_by"
        )


class AlertStatsView(APIView):
    @extend_schema(responses=s.AlertStatsSerializer)
    def get(self, request):
        return Response(selectors.alert_stats(request.auth))


class AlertView(ScopedAPIView):
    """One alert by the id in its URL, among those the caller may see (404 otherwise)."""

    queryset = Alert.objects.all()


class AlertDetailView(AlertView):
    @extend_schema(responses=s.AlertSerializer)
    def get(self, request, pk):
        return Response(s.AlertSerializer(self.get_object()).data)


class AlertAcknowledgeView(AlertView):
    """Anyone who can see an active alert may say they are on it."""

    @extend_schema(request=None, responses=s.AlertSerializer)
    def post(self, request, pk):
        alert = self.get_object()
        if not services.acknowledge_alert(alert, request.auth.user) and alert.state != "ACTIVE":
            raise Conflict(
                f"Alert {alert.pk} is {alert.state}; only an active alert can be acknowledged.",
                AlertErrorCode.ALERT_ENDED,
            )
        return Response(s.AlertSerializer(alert).data)


class AlertResolveView(AlertView):
    """Operators resolve any alert; a tenant admin resolves their tenant's own."""

    @extend_schema(request=None, responses=s.AlertSerializer)
    def post(self, request, pk):
        alert = self.get_object()
        principal = request.auth
        if not policy.may_resolve_alert(principal, alert):
            raise PermissionDenied("Only platform operators and the tenant's admins can resolve alerts.")
        if not services.resolve_alert(alert, principal.user):
            raise Conflict(f"Alert {alert.pk} is already {alert.state}.", AlertErrorCode.ALERT_ENDED)
        return Response(s.AlertSerializer(alert).data)
