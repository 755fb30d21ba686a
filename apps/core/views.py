"""The scoped base view of the API, and the one scoped lookup that API views and portal
pages share.

A row outside the principal's scope is absent, not forbidden: reading it by id answers
404 and never tells that it exists. So no view narrows a queryset or looks a row up by
itself: it names its model (or a queryset of it) and reads through `get_queryset()` and
`get_object()` here, as NetBox's BaseViewSet.initial restricts `self.queryset` once per
request before any handler runs."""

from __future__ import annotations

from django.db import models
from django.shortcuts import get_object_or_404
from rest_framework.generics import GenericAPIView


def visible(model_or_queryset, principal) -> models.QuerySet:
    """The rows of a ScopedQuerySet's model that `principal` may see."""
    if isinstance(model_or_queryset, models.QuerySet):
        return model_or_queryset.visible_to(principal)
    return model_or_queryset.objects.visible_to(principal)


def get_visible_or_404(model_or_queryset, principal, **lookup):
    """One row by `lookup` among those `principal` may see; Http404 (the API answers 404)
    for a row that does not exist and for one outside the principal's scope alike."""
    return get_object_or_404(visible(model_or_queryset, principal), **lookup)


class ScopedAPIView(GenericAPIView):
    """An API view over one shared table. Set `queryset` (or `model`), and `lookup_field`
    / `lookup_url_kwarg` as GenericAPIView does. After authentication and permissions,
    `initial` narrows the queryset to `visible_to(request.auth)` once; `get_queryset()`
    then only ever returns that, and `get_object()` answers 404 outside it. A view that
    needs more (filters, select_related) overrides `get_queryset()` starting from
    `super().get_queryset()`, so it cannot read past the scope."""

    model: type[models.Model] | None = None

    def base_queryset(self) -> models.QuerySet:
        return self.queryset.all() if self.queryset is not None else self.model._default_manager.all()

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)  # authentication and permissions first
        self.scoped_queryset = visible(self.base_queryset(), request.auth)

    def get_queryset(self):
        scoped = getattr(self, "scoped_queryset", None)
        if scoped is None:  # no request went through initial (the schema generator asking for the model)
            return self.base_queryset().none()
        return scoped.all()

    def get_object(self):
        url_kwarg = self.lookup_url_kwarg or self.lookup_field
        obj = get_object_or_404(self.get_queryset(), **{self.lookup_field: self.kwargs[url_kwarg]})
        self.check_object_permissions(self.request, obj)
        return obj
