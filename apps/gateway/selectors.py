"""Reads of the gateway's tables shared by the API and the pages."""

from __future__ import annotations

from django.db.models import Count, Sum


def usage_rows(buckets, *, key=None, model="", service=None, since=None, until=None):
    """Usage buckets (already scoped), filtered in SQL, newest minute first."""
    if key is not None:
        buckets = buckets.filter(key_id=key)
    if model:
        buckets = buckets.filter(model=model)
    if service is not None:
        buckets = buckets.filter(service_id=service)
    if since is not None:
        buckets = buckets.filter(minute__gte=since)
    if until is not None:
        buckets = buckets.filter(minute__lt=until)
    return buckets.order_by("-minute", "id")


def usage_totals(buckets) -> list[dict]:
    """Per key and model over the buckets given: requests, errors, tokens, GPU-seconds,
    minutes used."""
    return list(
        buckets.order_by()
        .values("tenant__slug", "key_id", "key__name", "model")
        .annotate(
            requests=Sum("requests"),
            errors=Sum("errors"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            gpu_seconds=Sum("gpu_seconds"),
            minutes=Count("id"),
        )
        .order_by("tenant__slug", "key__name", "model")
    )


def usage_per_minute(buckets, since) -> list[dict]:
    """Requests, errors, tokens and GPU-seconds per minute since `since` (already scoped),
    oldest first."""
    return list(
        buckets.filter(minute__gte=since)
        .order_by()
        .values("minute")
        .annotate(
            requests=Sum("requests"),
            errors=Sum("errors"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            gpu_seconds=Sum("gpu_seconds"),
        )
        .order_by("minute")
    )
