"""Helpers the pages share."""

from __future__ import annotations

from django.core.paginator import Paginator
from django.http import Http404
from rest_framework.exceptions import PermissionDenied, ValidationError

from apps.core.errors import Conflict

PAGE_SIZE = 24


def paginate(request, items, per_page: int = PAGE_SIZE):
    """One page of a queryset, counted and sliced in SQL."""
    return Paginator(items, per_page).get_page(request.GET.get("page"))


def choice(value: str, allowed, default: str = "") -> str:
    return value if value in allowed else default


def error_messages(exc: ValidationError) -> dict[str, list[str]]:
    """A DRF validation error as field -> messages, the same words the API answers with."""
    detail = exc.detail
    if not isinstance(detail, dict):
        return {"__all__": [str(m) for m in (detail if isinstance(detail, list) else [detail])]}
    return {field: flatten(messages) for field, messages in detail.items()}


def flatten(messages) -> list[str]:
    if isinstance(messages, dict):
        return [f"{key}: {text}" for key, value in messages.items() for text in flatten(value)]
    if isinstance(messages, list):
        return [text for item in messages for text in flatten(item)]
    return [str(messages)]


def through_api(serializer_class, data: dict, act):
    """A form handled as the API handles the same request: validated by the API's own
    serializer, then `act(validated_data)`. Returns (result, errors), errors by field
    in the API's words ("__all__" for a refusal or a conflict)."""
    serializer = serializer_class(data=data)
    try:
        serializer.is_valid(raise_exception=True)
        return act(serializer.validated_data), {}
    except ValidationError as exc:
        return None, error_messages(exc)
    except (PermissionDenied, Conflict) as exc:
        return None, {"__all__": flatten(exc.detail)}


def through_api_for_a_tenant(serializer_class, data: dict, act):
    """through_api for a submit form whose body may name a tenant (operators do): a tenant
    the principal cannot see (the API's 404) is that field's error, as the API answers."""
    try:
        return through_api(serializer_class, data, act)
    except Http404:
        return None, {"tenant": ["Not found."]}
