"""Tenancy API. Views decode, scope and call services; the rules live in services.py."""

from django.shortcuts import get_object_or_404
from django.utils.dateparse import parse_datetime
from django_tenants.utils import schema_context
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, status
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.confidential.models import AuditEvent
from apps.core.models import OperatorAuditEvent
from apps.core.permissions import IsOperator
from apps.core.views import ScopedAPIView, get_visible_or_404
from apps.identity.session import refuse_stale_session
from apps.tenants import policy, services
from apps.tenants.api import serializers as s
from apps.tenants.choices import KeyScope
from apps.tenants.models import ApiKey, Membership, Tenant, TenantGroup


def require_tenant_admin(request, tenant: Tenant) -> None:
    if not policy.may_manage_tenant(request.auth, tenant):
        raise PermissionDenied("Only this tenant's admins and platform operators can do this.")


class TenantListView(generics.ListCreateAPIView):
    serializer_class = s.TenantSerializer

    def get_queryset(self):
        return Tenant.objects.visible_to(self.request.auth).order_by("name")

    def create(self, request, *args, **kwargs):
        if not request.auth.is_operator:
            raise PermissionDenied("Only platform operators can create tenants.")
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        tenant = services.create_tenant(principal=request.auth, **serializer.validated_data)
        return Response(s.TenantSerializer(tenant).data, status=status.HTTP_201_CREATED)


class TenantDetailView(ScopedAPIView):
    queryset = Tenant.objects.all()
    lookup_field = "slug"

    @extend_schema(responses=s.TenantSerializer)
    def get(self, request, slug):
        return Response(s.TenantSerializer(self.get_object()).data)

    @extend_schema(request=s.TenantUpdateSerializer, responses=s.TenantSerializer)
    def patch(self, request, slug):
        tenant = self.get_object()
        if not request.auth.is_operator:
            raise PermissionDenied("Only platform operators can change a tenant or its quotas.")
        serializer = s.TenantUpdateSerializer(tenant, data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        tenant = services.update_tenant(tenant, principal=request.auth, **serializer.validated_data)
        return Response(s.TenantSerializer(tenant).data)

    @extend_schema(responses={204: None})
    def delete(self, request, slug):
        tenant = self.get_object()
        if not request.auth.is_operator:
            raise PermissionDenied("Only platform operators can delete tenants.")
        services.delete_tenant(tenant)
        return Response(status=status.HTTP_204_NO_CONTENT)


class MemberListView(generics.ListAPIView):
    serializer_class = s.MemberSerializer

    def get_queryset(self):
        tenant = policy.tenant_by_slug(self.request.auth, self.kwargs["slug"])
        return (
            Membership.objects.visible_to(self.request.auth)
            .filter(tenant=tenant)
            .select_related("user")
            .order_by("user__username")
        )

    @extend_schema(request=s.MemberCreateSerializer, responses={201: s.MemberCreatedSerializer})
    def post(self, request, slug):
        tenant = policy.tenant_by_slug(request.auth, slug)
        require_tenant_admin(request, tenant)
        serializer = s.MemberCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        added = services.add_member(tenant, principal=request.auth, **serializer.validated_data)
        data = s.MemberSerializer(added.membership).data | {
            "user_created": added.user_created,
            "initial_password": added.initial_password,
        }
        return Response(data, status=status.HTTP_201_CREATED)


class MemberDetailView(APIView):
    def get_membership(self, request, slug, username):
        tenant = policy.tenant_by_slug(request.auth, slug)
        return get_visible_or_404(
            Membership.objects.select_related("user", "tenant"), request.auth, tenant=tenant, user__username=username
        )

    @extend_schema(responses=s.MemberSerializer)
    def get(self, request, slug, username):
        return Response(s.MemberSerializer(self.get_membership(request, slug, username)).data)

    @extend_schema(request=s.MemberUpdateSerializer, responses=s.MemberSerializer)
    def patch(self, request, slug, username):
        membership = self.get_membership(request, slug, username)
        require_tenant_admin(request, membership.tenant)
        serializer = s.MemberUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        membership = services.change_member_role(membership, serializer.validated_data["role"], principal=request.auth)
        return Response(s.MemberSerializer(membership).data)

    @extend_schema(responses={204: None})
    def delete(self, request, slug, username):
        membership = self.get_membership(request, slug, username)
        require_tenant_admin(request, membership.tenant)
        services.remove_member(membership, principal=request.auth)
        return Response(status=status.HTTP_204_NO_CONTENT)


class AuditLogView(generics.ListAPIView):
    """The tenant's audit log, read from the tenant's own schema."""

    serializer_class = s.AuditEventSerializer

    def list(self, request, slug):
        tenant = policy.tenant_by_slug(request.auth, slug)
        require_tenant_admin(request, tenant)
        with schema_context(tenant.schema_name):
            page = self.paginate_queryset(AuditEvent.objects.all())
            data = s.AuditEventSerializer(page, many=True).data
        return self.get_paginated_response(data)


class OperatorAuditLogView(generics.ListAPIView):
    """The operators' audit log: every change an operator made, the platform's and each
    tenant's (a tenant's own people's changes are in that tenant's log). Filters:
    `tenant` (a slug; `-` for the platform's), `actor`, `action` (a part of it), `since`."""

    serializer_class = s.OperatorAuditEventSerializer
    permission_classes = [IsOperator]

    @extend_schema(
        parameters=[
            OpenApiParameter("tenant", str, description="a tenant's slug, or - for the platform's changes"),
            OpenApiParameter("actor", str),
            OpenApiParameter("action", str, description="a part of the action"),
            OpenApiParameter("since", OpenApiTypes.DATETIME),
        ]
    )
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    def get_queryset(self):
        rows = OperatorAuditEvent.objects.all()
        query = self.request.query_params
        if "tenant" in query:
            rows = rows.filter(tenant="" if query["tenant"] == "-" else query["tenant"])
        if query.get("actor"):
            rows = rows.filter(actor=query["actor"])
        if query.get("action"):
            rows = rows.filter(action__icontains=query["action"])
        if query.get("since"):
            try:
                since = parse_datetime(query["since"])
            except ValueError:
                since = None
            if since is None:
                raise ValidationError({"since": ["An ISO 8601 date and time, e.g. 2026-12-01T00:00:00Z."]})
            rows = rows.filter(at__gte=since)
        return rows


class ApiKeyListView(generics.ListAPIView):
    serializer_class = s.ApiKeySerializer

    def get_queryset(self):
        return ApiKey.objects.visible_to(self.request.auth).select_related("tenant", "user")

    @extend_schema(request=s.ApiKeyCreateSerializer, responses={201: s.ApiKeyCreatedSerializer})
    def post(self, request):
        refuse_stale_session(request)  # HETEROFLOW_REAUTH_SECONDS (apps.identity.session)
        serializer = s.ApiKeyCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        principal = request.auth
        if data["scope"] == KeyScope.PLATFORM:
            if not principal.is_operator:
                raise PermissionDenied("Only platform operators can issue platform keys.")
            issued = services.issue_platform_key(
                user=principal.user, name=data["name"], expires_at=data.get("expires_at")
            )
        else:
            issued = services.issue_tenant_key(
                principal=principal,
                tenant=policy.acting_tenant(principal, data.get("tenant"), required=policy.KEY_TENANT_REQUIRED),
                owner=policy.key_owner(principal, data.get("username")),
                name=data["name"],
                role=data.get("role"),
                expires_at=data.get("expires_at"),
            )
        body = s.ApiKeySerializer(issued.api_key).data | {"key": issued.key}
        return Response(body, status=status.HTTP_201_CREATED)


class ApiKeyDetailView(ScopedAPIView):
    queryset = ApiKey.objects.select_related("tenant", "user")

    @extend_schema(responses=s.ApiKeySerializer)
    def get(self, request, pk):
        return Response(s.ApiKeySerializer(self.get_object()).data)

    @extend_schema(responses={204: None})
    def delete(self, request, pk):
        services.revoke_key(self.get_object(), principal=request.auth)
        return Response(status=status.HTTP_204_NO_CONTENT)


class TenantGroupListView(generics.ListAPIView):
    permission_classes = [IsOperator]
    serializer_class = s.TenantGroupSerializer
    queryset = TenantGroup.objects.prefetch_related("tenants")

    @extend_schema(request=s.TenantGroupSerializer, responses={201: s.TenantGroupSerializer})
    def post(self, request):
        serializer = s.TenantGroupSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        group = services.save_group(None, **serializer.validated_data)
        return Response(s.TenantGroupSerializer(group).data, status=status.HTTP_201_CREATED)


class TenantGroupDetailView(APIView):
    permission_classes = [IsOperator]

    @extend_schema(responses=s.TenantGroupSerializer)
    def get(self, request, pk):
        return Response(s.TenantGroupSerializer(get_object_or_404(TenantGroup, pk=pk)).data)

    @extend_schema(request=s.TenantGroupSerializer, responses=s.TenantGroupSerializer)
    def patch(self, request, pk):
        group = get_object_or_404(TenantGroup, pk=pk)
        serializer = s.TenantGroupSerializer(group, data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        group = services.save_group(
            group,
            name=data.get("name", group.name),
            description=data.get("description", group.description),
            tenants=data.get("tenants"),
        )
        return Response(s.TenantGroupSerializer(group).data)

    @extend_schema(responses={204: None})
    def delete(self, request, pk):
        get_object_or_404(TenantGroup, pk=pk).delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class MeView(APIView):
    """Who the credentials belong to and what they may act as."""

    @extend_schema(responses=s.PrincipalSerializer)
    def get(self, request):
        principal = request.auth
        memberships = principal.user.memberships.by_tenant_name()
        return Response(
            {
                "kind": principal.kind,
                "username": principal.user.username,
                "tenant": principal.tenant.slug if principal.tenant else None,
                "role": principal.role,
                "memberships": [{"tenant": m.tenant.slug, "role": m.role} for m in memberships],
            }
        )
