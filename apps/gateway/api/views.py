"""The endpoint keys' management API (/api/v1/gateway/keys). Tenant keys (sk-tenant-),
operators' keys and sessions call it; an endpoint key (sk-hf-) does not (401: it calls
/v1/* only). Views decode, scope and call apps.gateway.services."""

from drf_spectacular.utils import extend_schema
from rest_framework import generics, status
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from apps.core.views import ScopedAPIView
from apps.gateway import selectors, services
from apps.gateway.api import serializers as s
from apps.gateway.models import EndpointKey, ExternalBackend, ServiceRoute, UsageBucket
from apps.inference.models import InferenceService
from apps.tenants import policy

KEY_TENANT_REQUIRED = "Required: the slug of the tenant the endpoint key belongs to."


class EndpointKeyListView(ScopedAPIView, generics.ListAPIView):
    queryset = EndpointKey.objects.select_related("tenant", "created_by")
    serializer_class = s.EndpointKeySerializer

    @extend_schema(request=s.EndpointKeyCreateSerializer, responses={201: s.EndpointKeyCreatedSerializer})
    def post(self, request):
        serializer = s.EndpointKeyCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        tenant = policy.acting_tenant(request.auth, data.pop("tenant", None), required=KEY_TENANT_REQUIRED)
        issued = services.create_key(request.auth, tenant=tenant, **data)
        body = s.EndpointKeySerializer(issued.endpoint_key).data | {"key": issued.key}
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})


class EndpointKeyDetailView(ScopedAPIView):
    queryset = EndpointKey.objects.select_related("tenant", "created_by")

    @extend_schema(responses=s.EndpointKeySerializer)
    def get(self, request, pk):
        return Response(s.EndpointKeySerializer(self.get_object()).data)

    @extend_schema(request=s.EndpointKeyUpdateSerializer, responses=s.EndpointKeySerializer)
    def patch(self, request, pk):
        endpoint_key = self.get_object()
        serializer = s.EndpointKeyUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        endpoint_key = services.update_key(request.auth, endpoint_key, **serializer.validated_data)
        return Response(s.EndpointKeySerializer(endpoint_key).data)

    @extend_schema(responses={204: None})
    def delete(self, request, pk):
        services.revoke_key(request.auth, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


class EndpointKeyRotateView(ScopedAPIView):
    queryset = EndpointKey.objects.select_related("tenant", "created_by")

    @extend_schema(request=s.EndpointKeyRotateSerializer, responses={200: s.EndpointKeyCreatedSerializer})
    def post(self, request, pk):
        endpoint_key = self.get_object()
        serializer = s.EndpointKeyRotateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = services.rotate_key(request.auth, endpoint_key, **serializer.validated_data)
        body = s.EndpointKeySerializer(issued.endpoint_key).data | {"key": issued.key}
        return Response(body, headers={"Cache-Control": "no-store"})


class UsageView(ScopedAPIView, generics.ListAPIView):
    """The caller's usage buckets (per key, model, service and minute), newest first, paged;
    `?key=`, `?model=`, `?service=`, `?since=`, `?until=` filter in SQL. `totals` sums the
    filtered buckets per key and model."""

    queryset = UsageBucket.objects.select_related("tenant")
    serializer_class = s.UsageBucketSerializer

    @extend_schema(parameters=[s.UsageQuerySerializer])
    def get(self, request, *args, **kwargs):
        query = s.UsageQuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        params = {name: value for name, value in query.validated_data.items() if name not in ("limit", "offset")}
        rows = selectors.usage_rows(self.get_queryset(), **params)
        page = self.paginate_queryset(rows)
        response = self.get_paginated_response(s.UsageBucketSerializer(page, many=True).data)
        response.data["totals"] = s.UsageTotalSerializer(selectors.usage_totals(rows), many=True).data
        return response


class ExternalBackendListView(ScopedAPIView, generics.ListAPIView):
    """External OpenAI-compatible backends: tenants see theirs, operators declare them."""

    queryset = ExternalBackend.objects.select_related("tenant")
    serializer_class = s.ExternalBackendSerializer

    @extend_schema(request=s.ExternalBackendWriteSerializer, responses={201: s.ExternalBackendSerializer})
    def post(self, request):
        serializer = s.ExternalBackendWriteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        if not request.auth.is_operator:
            raise PermissionDenied("Only platform operators declare external backends.")
        tenant = policy.named_tenant(request.auth, data.pop("tenant"))
        backend = services.declare_external_backend(request.auth, tenant=tenant, **data)
        return Response(s.ExternalBackendSerializer(backend).data, status=status.HTTP_201_CREATED)


class ExternalBackendDetailView(ScopedAPIView):
    queryset = ExternalBackend.objects.select_related("tenant")

    @extend_schema(responses=s.ExternalBackendSerializer)
    def get(self, request, pk):
        return Response(s.ExternalBackendSerializer(self.get_object()).data)

    @extend_schema(request=s.ExternalBackendUpdateSerializer, responses=s.ExternalBackendSerializer)
    def patch(self, request, pk):
        backend = self.get_object()
        serializer = s.ExternalBackendUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        backend = services.change_external_backend(request.auth, backend, **serializer.validated_data)
        return Response(s.ExternalBackendSerializer(backend).data)

    @extend_schema(responses={204: None})
    def delete(self, request, pk):
        services.remove_external_backend(request.auth, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


def route_body(service) -> dict:
    route = ServiceRoute.objects.filter(service=service).first()
    return {
        "service": service.pk,
        "model": service.model.name,
        "priority": route.priority if route else 0,
        "weight": route.weight if route else 100,
    }


class ServiceRouteView(ScopedAPIView):
    """How the gateway shares a model name among the services serving it: GET the service's
    priority and weight (defaults 0 and 100), PATCH them (members, admins, operators)."""

    queryset = InferenceService.objects.select_related("model", "group__tenant")

    @extend_schema(responses=s.ServiceRouteSerializer)
    def get(self, request, pk):
        return Response(route_body(self.get_object()))

    @extend_schema(request=s.ServiceRouteUpdateSerializer, responses=s.ServiceRouteSerializer)
    def patch(self, request, pk):
        service = self.get_object()
        serializer = s.ServiceRouteUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.set_service_route(request.auth, service, **serializer.validated_data)
        return Response(route_body(service))
