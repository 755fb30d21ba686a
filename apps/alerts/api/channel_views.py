"""Notification channels. Views decode, scope and call apps.alerts.notifications.

Who: a tenant's admins manage (and read) their tenant's channels; its members and
viewers get 403 (a channel's URL and recipients are its admins' business). Operators
manage the operators' channels and every tenant's. A channel outside the principal's
scope is 404. The agent key gets 403, as everywhere outside the agent endpoints.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, status
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.response import Response

from apps.alerts.api import channel_serializers as s
from apps.alerts.models import NotificationChannel
from apps.alerts.notifications import channels as services
from apps.alerts.notifications.selectors import channel_list, delivery_list, webhook_urls
from apps.core.views import ScopedAPIView
from apps.tenants import policy
from apps.tenants.models import Tenant

MANAGERS_ONLY = "Only this tenant's admins and platform operators can see or change its notification channels."


def require_channel_manager(request) -> None:
    principal = request.auth
    if not (principal.is_operator or principal.is_tenant_admin):
        raise PermissionDenied(MANAGERS_ONLY)


class ChannelView(ScopedAPIView):
    """One channel by the id in its URL: 404 outside the principal's scope, then 403 for a
    tenant's members and viewers."""

    queryset = NotificationChannel.objects.select_related("tenant", "created_by")

    def get_object(self):
        channel = super().get_object()
        require_channel_manager(self.request)
        return channel


def channel_body(channel: NotificationChannel, **extra) -> dict:
    return s.ChannelSerializer(channel, context={"urls": webhook_urls([channel])}).data | extra


def _tenant_for_new_channel(principal, data: dict) -> Tenant | None:
    if "tenant" not in data:
        return principal.tenant if principal.is_tenant else None
    slug = data["tenant"]
    if slug is None:
        if principal.is_tenant:
            raise ValidationError(
                {"tenant": ["Tenants' channels belong to their tenant; only operators have channels of no tenant."]}
            )
        return None
    return policy.named_tenant(principal, slug)


class ChannelListView(generics.ListAPIView):
    serializer_class = s.ChannelSerializer

    def get_queryset(self):
        return channel_list(self.request.auth, tenant_slug=self.request.query_params.get("tenant") or None)

    @extend_schema(
        parameters=[OpenApiParameter("tenant", OpenApiTypes.STR, description="only this tenant's channels (slug)")],
        responses=s.ChannelSerializer(many=True),
    )
    def get(self, request, *args, **kwargs):
        require_channel_manager(request)
        page = self.paginate_queryset(self.get_queryset())
        data = s.ChannelSerializer(page, many=True, context={"urls": webhook_urls(page)}).data
        return self.get_paginated_response(data)

    @extend_schema(request=s.ChannelCreateSerializer, responses={201: s.ChannelCreatedSerializer})
    def post(self, request):
        require_channel_manager(request)
        serializer = s.ChannelCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        tenant = _tenant_for_new_channel(request.auth, data)
        data.pop("tenant", None)
        created = services.create_channel(principal=request.auth, tenant=tenant, **data)
        body = s.ChannelCreatedSerializer(created.channel, context={"urls": {created.channel.pk: created.url}}).data
        return Response(body | {"secret": created.secret}, status=status.HTTP_201_CREATED)


class ChannelDetailView(ChannelView):
    @extend_schema(responses=s.ChannelSerializer)
    def get(self, request, pk):
        return Response(channel_body(self.get_object()))

    @extend_schema(request=s.ChannelUpdateSerializer, responses=s.ChannelSerializer)
    def patch(self, request, pk):
        channel = self.get_object()
        serializer = s.ChannelUpdateSerializer(data=request.data, context={"kind": channel.kind})
        serializer.is_valid(raise_exception=True)
        channel = services.update_channel(channel, principal=request.auth, **serializer.validated_data)
        return Response(channel_body(channel))

    @extend_schema(responses={204: None})
    def delete(self, request, pk):
        services.delete_channel(self.get_object(), principal=request.auth)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ChannelTestView(ChannelView):
    @extend_schema(request=s.NoBodySerializer, responses={202: s.TestQueuedSerializer})
    def post(self, request, pk):
        channel = self.get_object()
        s.NoBodySerializer(data=request.data).is_valid(raise_exception=True)
        delivery = services.send_test(channel, principal=request.auth)
        return Response({"delivery": delivery.pk, "status": delivery.status}, status=status.HTTP_202_ACCEPTED)


class ChannelRotateSecretView(ChannelView):
    @extend_schema(request=s.NoBodySerializer, responses=s.ChannelSecretSerializer)
    def post(self, request, pk):
        channel = self.get_object()
        s.NoBodySerializer(data=request.data).is_valid(raise_exception=True)
        return Response({"id": channel.pk, "secret": services.rotate_secret(channel, principal=request.auth)})


class ChannelDeliveryListView(ChannelView):
    """The channel's deliveries, newest first."""

    @extend_schema(responses=s.DeliverySerializer(many=True))
    def get(self, request, pk):
        page = self.paginate_queryset(delivery_list(self.get_object()))
        return self.get_paginated_response(s.DeliverySerializer(page, many=True).data)
