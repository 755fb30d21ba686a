"""Queues (docs/queues.md): operators set each tenant's (`/admin/queues`), a tenant's
people see theirs (`/queue`)."""

from __future__ import annotations

from django.db.models import Q
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.clock import utcnow
from apps.core.permissions import IsOperator
from apps.core.principals import PrincipalKind
from apps.core.serializers import StrictSerializer
from apps.nodes.choices import GpuVendor
from apps.scheduler import quotas
from apps.tasks.choices import TaskStatus
from apps.tasks.models import Task
from apps.tenants.models import Tenant

MAX_WEIGHT = 1000.0
PENDING_SHOWN = 50


class QuotaSerializer(StrictSerializer):
    gpu_type = serializers.ChoiceField(choices=GpuVendor.choices, help_text="the GPU vendor")
    nominal = serializers.IntegerField(min_value=0, max_value=1_000_000)
    borrowing_limit = serializers.IntegerField(min_value=0, max_value=1_000_000, allow_null=True, required=False)
    lending_limit = serializers.IntegerField(min_value=0, max_value=1_000_000, allow_null=True, required=False)


class QueueSerializer(StrictSerializer):
    cohort = serializers.SlugField(max_length=40, allow_null=True)
    weight = serializers.FloatField(min_value=0.001, max_value=MAX_WEIGHT, default=1.0)
    quotas = QuotaSerializer(many=True)

    def validate_quotas(self, value):
        types = [quota["gpu_type"] for quota in value]
        twice = sorted({gpu_type for gpu_type in types if types.count(gpu_type) > 1})
        if twice:
            raise serializers.ValidationError(f"One quota per GPU type: {', '.join(twice)} given more than once.")
        return value


class TypeUseSerializer(serializers.Serializer):
    gpu_type = serializers.CharField()
    nominal = serializers.FloatField()
    used = serializers.FloatField()
    borrowed = serializers.FloatField()
    lent = serializers.FloatField()
    borrowing_limit = serializers.FloatField(allow_null=True)
    lending_limit = serializers.FloatField(allow_null=True)


class QueueViewSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    cohort = serializers.CharField(allow_null=True)
    weight = serializers.FloatField()
    usage_above_nominal_gpu_hours = serializers.FloatField()
    dominant_share = serializers.FloatField()
    fair_share_place = serializers.IntegerField()
    fair_share_of = serializers.IntegerField()
    types = TypeUseSerializer(many=True)


class TenantQueueRow(serializers.Serializer):
    tenant = serializers.CharField()
    queue = QueueViewSerializer(allow_null=True, help_text="null: no queue, not limited by queues")


class TenantQueueList(serializers.Serializer):
    results = TenantQueueRow(many=True)


class TenantQueueSet(TenantQueueRow):
    warnings = serializers.ListField(child=serializers.CharField())


class PendingWork(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    group_id = serializers.IntegerField(allow_null=True)
    gpus = serializers.IntegerField()
    gpu_type = serializers.CharField()
    priority = serializers.IntegerField()
    reason = serializers.CharField()


class MyQueue(TenantQueueRow):
    pending = PendingWork(many=True, help_text=f"the first {PENDING_SHOWN}, in queue order")
    pending_count = serializers.IntegerField()


def tenant_row(book, tenant: Tenant) -> dict:
    view = quotas.tenant_view(book, tenant.pk)
    return {"tenant": tenant.slug, "queue": None if view.get("queue", 0) is None else view}


class AdminQueueListView(APIView):
    """Every tenant with its queue (null: none, not limited by queues) and its usage."""

    permission_classes = [IsOperator]

    @extend_schema(operation_id="admin_queues_list", responses=TenantQueueList)
    def get(self, request):
        book = quotas.queue_book(utcnow())
        return Response({"results": [tenant_row(book, tenant) for tenant in Tenant.objects.order_by("slug")]})


class AdminQueueView(APIView):
    """One tenant's queue; PUT replaces it (strict: every problem listed, nothing written
    on any); DELETE removes it (the tenant is no longer limited by queues)."""

    permission_classes = [IsOperator]

    def tenant(self, slug: str) -> Tenant:
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            raise NotFound(f"No tenant {slug!r}.")
        return tenant

    @extend_schema(responses=TenantQueueRow)
    def get(self, request, slug):
        tenant = self.tenant(slug)
        return Response(tenant_row(quotas.queue_book(utcnow()), tenant))

    @extend_schema(request=QueueSerializer, responses=TenantQueueSet)
    def put(self, request, slug):
        tenant = self.tenant(slug)
        body = QueueSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        warnings = quotas.set_queue(
            tenant,
            cohort=data["cohort"],
            weight=data["weight"],
            quotas=[quotas.QuotaInput(**quota) for quota in data["quotas"]],
            principal=request.auth,
        )
        return Response(tenant_row(quotas.queue_book(utcnow()), tenant) | {"warnings": warnings})

    @extend_schema(responses={204: None})
    def delete(self, request, slug):
        tenant = self.tenant(slug)
        if not quotas.remove_queue(tenant, principal=request.auth):
            raise NotFound(f"The tenant {slug!r} has no queue.")
        return Response(status=204)


class QueueView(APIView):
    """The caller's tenant's queue: per GPU type its nominal, used, borrowed and lent
    cards, its place in the fair-share order, and its pending work. An operator names
    the tenant (`?tenant=`)."""

    @extend_schema(
        parameters=[OpenApiParameter("tenant", str, description="operators: the tenant's slug")], responses=MyQueue
    )
    def get(self, request):
        principal = request.auth
        if principal.kind == PrincipalKind.OPERATOR:
            slug = request.query_params.get("tenant")
            if not slug:
                raise ValidationError({"tenant": ["Operators name the tenant: ?tenant=SLUG."]})
            tenant = Tenant.objects.filter(slug=slug).first()
            if tenant is None:
                raise NotFound(f"No tenant {slug!r}.")
        else:
            tenant = principal.tenant
            if tenant is None:
                raise PermissionDenied("You act in no tenant.")
        pending = (
            Task.objects.filter(tenant=tenant, status=TaskStatus.PENDING)
            .filter(Q(group__isnull=True) | Q(rank=0))
            .order_by("-priority", "created_at", "id")
        )
        return Response(
            tenant_row(quotas.queue_book(utcnow()), tenant)
            | {
                "pending": [
                    {
                        "id": task.pk,
                        "name": task.name,
                        "group_id": task.group_id,
                        "gpus": task.gpu_required,
                        "gpu_type": task.gpu_type,
                        "priority": task.priority,
                        "reason": (task.schedule_reason or {}).get("message", ""),
                    }
                    for task in pending[:PENDING_SHOWN]
                ],
                "pending_count": pending.count(),
            }
        )
