from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import generics, status
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.core.clock import utcnow
from apps.core.permissions import IsAgent
from apps.core.views import ScopedAPIView
from apps.inference import model_deletion, model_ensure, selectors, services
from apps.inference.api import serializers as s
from apps.inference.models import InferenceService, Model, ServiceDecision
from apps.tasks.choices import TaskKind
from apps.tasks.models import Task


def shown(models, **context) -> dict:
    """The serializer context for a page of models: where each is cached, in one query."""
    return {"cached_on": selectors.cached_on(models), **context}


class ModelListView(ScopedAPIView, generics.ListAPIView):
    """The caller's models by name, paged; `?model_format=` and `?engine=` filter in SQL. Each
    lists the nodes it is cached on. POST registers one."""

    queryset = Model.objects.all()
    serializer_class = s.ModelSerializer

    def get_queryset(self):
        return selectors.model_list(
            super().get_queryset(), format=self.params.get("model_format", ""), engine=self.params.get("engine", "")
        )

    @extend_schema(parameters=[s.ModelListQuerySerializer])
    def get(self, request, *args, **kwargs):
        serializer = s.ModelListQuerySerializer(data=request.query_params.dict())
        serializer.is_valid(raise_exception=True)
        self.params = serializer.validated_data
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(s.ModelSerializer(page, many=True, context=shown(page)).data)

    @extend_schema(request=s.ModelCreateSerializer, responses={201: s.ModelSerializer})
    def post(self, request):
        serializer = s.ModelCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        model = services.register_model(request.auth, serializer.validated_data)
        return Response(s.ModelSerializer(model, context=shown([model])).data, status=status.HTTP_201_CREATED)


class ModelDetailView(ScopedAPIView):
    """One model by id among the caller's (404 otherwise, another tenant's too)."""

    queryset = Model.objects.select_related("tenant").prefetch_related("nodes")

    def answer(self, model) -> Response:
        return Response(s.ModelSerializer(model, context=shown([model])).data)

    @extend_schema(responses=s.ModelSerializer)
    def get(self, request, pk):
        return self.answer(self.get_object())

    @extend_schema(request=s.ModelUpdateSerializer, responses=s.ModelSerializer)
    def patch(self, request, pk):
        model = self.get_object()
        serializer = s.ModelUpdateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.update_model(request.auth, model, serializer.validated_data)
        return self.answer(self.get_object())

    @extend_schema(request=None, responses={204: None, 409: None})
    def delete(self, request, pk):
        """409 `model_in_use` naming the services not stopped that use it; the records
        of stopped ones go with it."""
        model_deletion.delete_model(request.auth, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- inference services ----------------------------------------------------------------------

SERVICES = InferenceService.objects.select_related("group__tenant", "group__created_by", "model")


def service_answer(service: InferenceService, **extra) -> Response:
    """A service as its detail shows it: with its replicas, its window and its latest
    decisions, read now."""
    fresh = SERVICES.get(pk=service.pk)
    context = {"members": services_replicas(fresh), "now": utcnow()}
    return Response(s.ServiceDetailSerializer(fresh, context=context).data, **extra)


def services_replicas(service: InferenceService) -> list:
    """replicas_of's rows, each with its model's download while its node fetches it."""
    rows = [dict(row) for row in selectors.replicas_of(service)]
    fetching = model_ensure.progress_of([row["task_id"] for row in rows])
    for row in rows:
        row["model_fetch"] = fetching.get(row["task_id"])
    return rows


class ServiceListView(ScopedAPIView, generics.ListAPIView):
    """The caller's inference services, newest first, paged; `?state=` and `?model=` (a
    model's name) filter. POST deploys one."""

    queryset = SERVICES
    serializer_class = s.ServiceSerializer

    def get_queryset(self):
        services = super().get_queryset().order_by("-created_at", "-group_id")
        if self.params.get("state"):
            services = services.filter(state=self.params["state"])
        if self.params.get("model"):
            services = services.filter(model__name=self.params["model"])
        return services

    @extend_schema(parameters=[s.ServiceListQuerySerializer])
    def get(self, request, *args, **kwargs):
        serializer = s.ServiceListQuerySerializer(data=request.query_params.dict())
        serializer.is_valid(raise_exception=True)
        self.params = serializer.validated_data
        return super().get(request, *args, **kwargs)

    @extend_schema(request=s.ServiceCreateSerializer, responses={201: s.ServiceDetailSerializer})
    def post(self, request):
        serializer = s.ServiceCreateSerializer(data=request.data, context={"principal": request.auth})
        serializer.is_valid(raise_exception=True)
        service = services.create_service(request.auth, serializer.validated_data)
        return service_answer(service, status=status.HTTP_201_CREATED)


class ServiceView(ScopedAPIView):
    """One service by the id in its URL (its group's), among the caller's (404 otherwise,
    another tenant's too)."""

    queryset = SERVICES
    lookup_url_kwarg = "id"  # {id} in the schema, as every other route (the primary key is `group`)


class ServiceDetailView(ServiceView):
    """A service with its replicas (node, port, state, health, address), the window's
    status and the latest decisions."""

    @extend_schema(responses=s.ServiceDetailSerializer)
    def get(self, request, id):
        return service_answer(self.get_object())


class ServiceScaleView(ServiceView):
    """A user's scale: {"replicas": n}, between the service's min_replicas and
    max_replicas. The AutoScaler may change the count again by its own rules."""

    @extend_schema(request=s.ServiceScaleSerializer, responses=s.ServiceDetailSerializer)
    def post(self, request, id):
        service = self.get_object()
        serializer = s.ServiceScaleSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        services.scale_by_user(request.auth, service, serializer.validated_data["replicas"])
        return service_answer(service)


class ServiceStopView(ServiceView):
    """Stop the service: every replica stopped, the service `stopping` then `stopped`
    (one-way). Asking again while it stops is 200; a stopped service is 409."""

    @extend_schema(request=None, responses=s.ServiceDetailSerializer)
    def post(self, request, id):
        service = self.get_object()
        services.stop_service(request.auth, service)
        return service_answer(service)


class ServiceWakeView(ServiceView):
    """Wake a sleeping service (`waking` until a replica is healthy); an awake one is
    200 and nothing changes; a paused, stopping or stopped one is 409."""

    @extend_schema(request=None, responses=s.ServiceDetailSerializer)
    def post(self, request, id):
        service = self.get_object()
        services.wake_service(request.auth, service)
        return service_answer(service)


class ServiceDecisionsView(ServiceView):
    """Every decision about the service with its reason, newest first, paged;
    `?source=` filters."""

    @extend_schema(parameters=[s.DecisionListQuerySerializer], responses=s.DecisionSerializer(many=True))
    def get(self, request, id):
        params = s.DecisionListQuerySerializer(data=request.query_params.dict())
        params.is_valid(raise_exception=True)
        service = self.get_object()
        decisions = ServiceDecision.objects.filter(service=service).order_by("-created_at", "-id")
        if params.validated_data.get("source"):
            decisions = decisions.filter(source=params.validated_data["source"])
        page = self.paginate_queryset(decisions)
        return self.get_paginated_response(s.DecisionSerializer(page, many=True).data)


class ModelEnsureReportView(APIView):
    """The agent of a replica's node reports on making its model present: download
    progress, the end of a download, or why it failed (apps.inference.model_ensure).
    204; 404 when the task is not an inference task on that node."""

    permission_classes = [IsAgent]

    @extend_schema(request=s.ModelEnsureReportSerializer, responses={204: None})
    def post(self, request, task_id):
        serializer = s.ModelEnsureReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        node_id, state = data.pop("node_id"), data.pop("state")
        task = get_object_or_404(Task, pk=task_id, node_id=node_id, kind=TaskKind.INFERENCE)
        model_ensure.report(task, node_id, state, data)
        return Response(status=status.HTTP_204_NO_CONTENT)
