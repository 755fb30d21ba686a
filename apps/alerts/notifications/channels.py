"""Every change to a notification channel. A webhook's URL and signing secret are
credentials: a tenant's channel keeps them in the tenant's schema (ChannelSecret), an
operators' channel in `public` (OperatorChannelSecret); both are reached through
`credential_store`. The secret leaves the server in two answers only: the one that
created it and the one that rotated it. A tenant's channel changes are recorded in that
tenant's audit log."""

from __future__ import annotations

import secrets
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

from django.db import IntegrityError, transaction
from django_tenants.utils import get_public_schema_name, schema_context

from apps.alerts.choices import ChannelKind, DeliveryStatus, NotificationEvent, Severity
from apps.alerts.error_codes import AlertErrorCode
from apps.alerts.models import NotificationChannel, NotificationDelivery, OperatorChannelSecret
from apps.confidential.models import ChannelCredentials, ChannelSecret
from apps.confidential.services import record_audit
from apps.core.clock import utcnow
from apps.core.enqueue import enqueue
from apps.core.errors import Conflict

UPDATABLE = frozenset({"name", "url", "recipients", "min_severity", "types", "enabled"})


def credential_store(channel: NotificationChannel) -> tuple[str, type[ChannelCredentials]]:
    """The schema and the table holding the channel's credentials. Use the table inside
    `schema_context(schema)`."""
    if channel.tenant_id:
        return channel.tenant.schema_name, ChannelSecret
    return get_public_schema_name(), OperatorChannelSecret


def new_secret() -> str:
    return secrets.token_urlsafe(32)


@contextmanager
def credentials_of(channel: NotificationChannel):
    """The manager of the channel's credential store, inside the store's schema."""
    schema, store = credential_store(channel)
    with schema_context(schema):
        yield store.objects


def read_credentials(channel: NotificationChannel) -> ChannelCredentials | None:
    with credentials_of(channel) as credentials:
        return credentials.filter(channel_id=channel.pk).first()


@dataclass(frozen=True)
class ChannelCreated:
    channel: NotificationChannel
    url: str
    secret: str | None  # webhooks: shown once, in the answer to the create


def _name_taken(channel_name: str) -> Conflict:
    return Conflict(
        f"A notification channel named '{channel_name}' exists already here.", AlertErrorCode.CHANNEL_EXISTS
    )


def _audit(channel: NotificationChannel, principal, action: str, **details) -> None:
    if channel.tenant_id:  # the operators' channels belong to no tenant's log
        record_audit(channel.tenant, principal, action, channel.name, channel_id=channel.pk, **details)


def create_channel(
    *,
    principal,
    tenant,
    name: str,
    kind: str,
    url: str = "",
    recipients=(),
    min_severity: str = Severity.INFO,
    types=(),
    enabled: bool = True,
) -> ChannelCreated:
    """`tenant` None: an operators' channel."""
    if NotificationChannel.objects.filter(tenant=tenant, name=name).exists():
        raise _name_taken(name)
    user = getattr(principal, "user", None)
    try:
        with transaction.atomic():
            channel = NotificationChannel.objects.create(
                tenant=tenant,
                name=name,
                kind=kind,
                recipients=list(recipients),
                min_severity=min_severity,
                types=list(types),
                enabled=enabled,
                created_by=user,
            )
            secret = None
            if kind == ChannelKind.WEBHOOK:
                secret = new_secret()
                with credentials_of(channel) as credentials:
                    credentials.create(channel_id=channel.pk, url=url, secret=secret)
            _audit(channel, principal, "alert_channel.created", kind=kind, **_described(channel, url))
    except IntegrityError:  # a concurrent create of the same name won
        raise _name_taken(name) from None
    return ChannelCreated(channel, url if kind == ChannelKind.WEBHOOK else "", secret)


def _described(channel: NotificationChannel, url: str) -> dict:
    """What the audit log records of a channel's settings: the URL's host only (its path
    or query may hold a token)."""
    described = {"min_severity": channel.min_severity, "types": list(channel.types), "enabled": channel.enabled}
    if channel.kind == ChannelKind.WEBHOOK:
        described["url_host"] = urlsplit(url).hostname or ""
    else:
        described["recipients"] = list(channel.recipients)
    return described


def update_channel(channel: NotificationChannel, *, principal, **changes) -> NotificationChannel:
    unknown = set(changes) - UPDATABLE
    if unknown:
        raise TypeError(f"update_channel() got unexpected fields: {', '.join(sorted(unknown))}")
    url = changes.pop("url", None)
    if url is not None and channel.kind != ChannelKind.WEBHOOK:
        raise TypeError("only webhook channels have a URL")
    if not changes and url is None:
        return channel  # nothing asked: nothing to save or to record
    if (
        "name" in changes
        and NotificationChannel.objects.filter(tenant=channel.tenant_id, name=changes["name"])
        .exclude(pk=channel.pk)
        .exists()
    ):
        raise _name_taken(changes["name"])
    try:
        with transaction.atomic():
            for field, value in changes.items():
                setattr(channel, field, list(value) if field in ("recipients", "types") else value)
            channel.save(update_fields=[*changes, "updated_at"])
            details = {field: value for field, value in changes.items()}
            if url is not None:
                with credentials_of(channel) as credentials:
                    credentials.filter(channel_id=channel.pk).update(url=url)
                details["url_host"] = urlsplit(url).hostname or ""
            _audit(channel, principal, "alert_channel.updated", **details)
    except IntegrityError:
        raise _name_taken(changes.get("name", channel.name)) from None
    return channel


def delete_channel(channel: NotificationChannel, *, principal) -> None:
    """Its credentials and its deliveries go with it; a delivery already queued finds
    nothing to send."""
    with transaction.atomic():
        with credentials_of(channel) as credentials:
            credentials.filter(channel_id=channel.pk).delete()
        _audit(channel, principal, "alert_channel.deleted", kind=channel.kind)
        channel.delete()


def rotate_secret(channel: NotificationChannel, *, principal) -> str:
    """A new signing secret, in force at once (pending retries are signed with it)."""
    if channel.kind != ChannelKind.WEBHOOK:
        raise Conflict("Only webhook channels have a signing secret.", AlertErrorCode.NOT_A_WEBHOOK)
    secret = new_secret()
    with transaction.atomic():
        with credentials_of(channel) as credentials:
            credentials.filter(channel_id=channel.pk).update(secret=secret, rotated_at=utcnow())
        _audit(channel, principal, "alert_channel.secret_rotated")
    return secret


def send_test(channel: NotificationChannel, *, principal) -> NotificationDelivery:
    """Queue a "test" delivery (sent even while the channel is disabled, so a channel can
    be tried before it is switched on). One at a time per channel."""
    with transaction.atomic():
        NotificationChannel.objects.select_for_update().filter(pk=channel.pk).exists()
        if NotificationDelivery.objects.filter(
            channel=channel, event=NotificationEvent.TEST, status=DeliveryStatus.PENDING
        ).exists():
            raise Conflict(
                "A test of this channel is still on its way; wait for its outcome.", AlertErrorCode.TEST_PENDING
            )
        delivery = NotificationDelivery.objects.create(
            channel=channel,
            event=NotificationEvent.TEST,
            next_attempt_at=utcnow(),
            payload={"alert": None, "message": f"A test notification from HeteroFlow for channel '{channel.name}'."},
        )
        _audit(channel, principal, "alert_channel.tested", delivery_id=delivery.pk)
        enqueue("alerts.deliver_notification", delivery.pk)
    return delivery
