"""Helpers the pages share."""

from __future__ import annotations

from django.core.paginator import Paginator
from rest_framework.exceptions import ValidationError

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
