from drf_spectacular.utils import extend_schema
from rest_framework import generics, status
from rest_framework.response import Response

from apps.core.views import ScopedAPIView
from apps.inference import selectors, services
from apps.inference.api import serializers as s
from apps.inference.models import Model


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

    @extend_schema(request=None, responses={204: None})
    def delete(self, request, pk):
        services.delete_model(request.auth, self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)
