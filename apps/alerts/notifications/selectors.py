"""Reads of notification channels shared by the API and the admin."""

from __future__ import annotations

from collections import defaultdict

from django_tenants.utils import schema_context

from apps.alerts.choices import ChannelKind
from apps.alerts.models import NotificationChannel, NotificationDelivery
from apps.alerts.notifications.channels import credential_store


def channel_list(principal, *, tenant_slug: str | None = None):
    channels = NotificationChannel.objects.visible_to(principal).select_related("tenant", "created_by")
    if tenant_slug:
        channels = channels.filter(tenant__slug=tenant_slug)
    return channels


def webhook_urls(channels) -> dict[int, str]:
    """Channel id → URL for the webhooks among `channels`: one query per store (a page
    of one tenant's channels is one query)."""
    wanted = defaultdict(list)
    for channel in channels:
        if channel.kind == ChannelKind.WEBHOOK:
            wanted[credential_store(channel)].append(channel.pk)
    urls = {}
    for (schema, store), ids in wanted.items():
        with schema_context(schema):
            urls.update(store.objects.filter(channel_id__in=ids).values_list("channel_id", "url"))
    return urls


def delivery_list(channel: NotificationChannel):
    return NotificationDelivery.objects.filter(channel=channel).order_by("-created_at", "-id")
