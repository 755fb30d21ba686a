"""One attempt of one delivery (the alerts.deliver_notification job).

The attempt is claimed first (`UPDATE … RETURNING`: pending, due, not held by another
attempt), so a duplicate queue message or a second worker sends nothing. The send runs
outside any transaction, with time-outs. Then the outcome is recorded:

- delivered (2xx; the mail server took the message): the channel's failure count resets;
- retried with exponential back-off: network errors and time-outs, HTTP 5xx, 408 and 429
  (a Retry-After is honoured up to the back-off cap), SMTP 4xx and unreachable mail
  servers; the job queues the next attempt with that delay;
- failed permanently: any other HTTP status (other 4xx, 3xx: redirects are not
  followed), SMTP 5xx, a tenant's webhook resolving to a non-public address, or the last
  attempt used. The failure is recorded on the channel.
"""

from __future__ import annotations

import email.utils
import ipaddress
import json
import re
import smtplib
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import requests
from django.conf import settings
from django.core.mail import EmailMessage
from django.db import connection, transaction
from django.db.models import F

from apps.alerts.choices import ChannelKind, DeliveryStatus, NotificationEvent
from apps.alerts.models import NotificationChannel, NotificationDelivery
from apps.alerts.notifications import signing
from apps.alerts.notifications.channels import read_credentials
from apps.core.clock import utcnow

USER_AGENT = "HeteroFlow-Notifications/1"
# a queue message may arrive a little before the time the database holds (clocks)
EARLY_TOLERANCE = timedelta(seconds=2)

CLAIM = """
    UPDATE alert_deliveries
    SET attempts = attempts + 1, locked_until = %(lease)s, last_attempt_at = %(now)s
    WHERE id = %(id)s AND status = 'pending' AND next_attempt_at <= %(due)s
      AND (locked_until IS NULL OR locked_until < %(now)s)
    RETURNING attempts
"""


@dataclass(frozen=True)
class Attempt:
    outcome: str  # delivered | retry | failed | cancelled | skipped (nothing to do)
    retry_in: float | None = None  # seconds until the next attempt, for the job to queue


@dataclass(frozen=True)
class Sent:
    ok: bool
    status_code: int | None = None
    error: str = ""
    permanent: bool = False
    retry_after: float | None = None


def lease_seconds() -> float:
    """How long an attempt holds its delivery: longer than any attempt can take (connect
    and read time-outs, a name lookup), so a worker that died mid-send frees it."""
    return 4 * settings.HETEROFLOW_NOTIFY_TIMEOUT_SECONDS + max(30.0, settings.EMAIL_TIMEOUT * 2)


def backoff_seconds(attempts: int, retry_after: float | None = None) -> float:
    cap = settings.HETEROFLOW_NOTIFY_BACKOFF_MAX_SECONDS
    delay = min(cap, settings.HETEROFLOW_NOTIFY_BACKOFF_SECONDS * 2 ** (attempts - 1))
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap))
    return delay


def deliver(delivery_id: int, *, now=None) -> Attempt:
    now = now or utcnow()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            CLAIM,
            {
                "id": delivery_id,
                "now": now,
                "due": now + EARLY_TOLERANCE,
                "lease": now + timedelta(seconds=lease_seconds()),
            },
        )
        if cursor.fetchone() is None:
            return Attempt("skipped")  # gone, finished, not due yet, or another attempt holds it
    delivery = NotificationDelivery.objects.select_related("channel__tenant").filter(pk=delivery_id).first()
    if delivery is None:
        return Attempt("skipped")  # its channel was deleted a moment ago
    channel = delivery.channel
    if delivery.attempts > settings.HETEROFLOW_NOTIFY_MAX_ATTEMPTS:
        # the worker that made the last attempt stopped before recording it
        return _record(
            delivery, now, Sent(False, error="no attempt left (the last one never finished)", permanent=True)
        )
    if delivery.event != NotificationEvent.TEST and not channel.enabled:
        NotificationDelivery.objects.filter(pk=delivery.pk, status=DeliveryStatus.PENDING).update(
            status=DeliveryStatus.CANCELLED, locked_until=None, last_error="the channel was disabled"
        )
        return Attempt("cancelled")
    sent = send_webhook(channel, delivery) if channel.kind == ChannelKind.WEBHOOK else send_email(channel, delivery)
    return _record(delivery, now, sent)


def _record(delivery: NotificationDelivery, now, sent: Sent) -> Attempt:
    pending = NotificationDelivery.objects.filter(pk=delivery.pk, status=DeliveryStatus.PENDING)
    channel = NotificationChannel.objects.filter(pk=delivery.channel_id)
    common = {"locked_until": None, "last_status_code": sent.status_code, "last_error": sent.error[:300]}
    with transaction.atomic():
        if sent.ok:
            pending.update(status=DeliveryStatus.DELIVERED, delivered_at=now, next_attempt_at=now, **common)
            channel.update(last_success_at=now, consecutive_failures=0)
            return Attempt("delivered")
        if sent.permanent or delivery.attempts >= settings.HETEROFLOW_NOTIFY_MAX_ATTEMPTS:
            error = sent.error if sent.permanent else f"{sent.error} (gave up after {delivery.attempts} attempts)"
            common["last_error"] = error[:300]
            pending.update(status=DeliveryStatus.FAILED, failed_at=now, next_attempt_at=now, **common)
            channel.update(
                last_failure_at=now, last_error=error[:300], consecutive_failures=F("consecutive_failures") + 1
            )
            return Attempt("failed")
        delay = backoff_seconds(delivery.attempts, sent.retry_after)
        pending.update(next_attempt_at=now + timedelta(seconds=delay), **common)
        return Attempt("retry", retry_in=delay)


# --- the body ------------------------------------------------------------------------------


def body_of(channel: NotificationChannel, delivery: NotificationDelivery, sent_at: datetime) -> dict:
    return {
        "event": delivery.event,
        "delivery": delivery.pk,
        "channel": {"id": channel.pk, "name": channel.name},
        **delivery.payload,  # "alert" (null for a test) and, for a test, "message"
        "sent_at": sent_at.isoformat(),
    }


# --- webhooks --------------------------------------------------------------------------------


def send_webhook(channel: NotificationChannel, delivery: NotificationDelivery) -> Sent:
    credentials = read_credentials(channel)
    if credentials is None:
        return Sent(False, error="the channel has no URL or secret stored", permanent=True)
    refused = _target_refused(channel, credentials.url)
    if refused is not None:
        return refused
    timeout = settings.HETEROFLOW_NOTIFY_TIMEOUT_SECONDS
    wall = int(time.time())  # the receiver checks freshness against its own clock: real time
    body = json.dumps(body_of(channel, delivery, datetime.fromtimestamp(wall, UTC)), separators=(",", ":")).encode()
    timestamp = str(wall)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        signing.EVENT_HEADER: delivery.event,
        signing.DELIVERY_HEADER: str(delivery.pk),
        signing.TIMESTAMP_HEADER: timestamp,
        signing.SIGNATURE_HEADER: signing.signature(credentials.secret, timestamp, body),
    }
    try:
        # stream: the answer's body is never read (only its status matters)
        with requests.post(
            credentials.url, data=body, headers=headers, timeout=(timeout, timeout), allow_redirects=False, stream=True
        ) as response:
            code, retry_after = response.status_code, response.headers.get("Retry-After")
    except requests.exceptions.ConnectTimeout:
        return Sent(False, error=f"could not connect within {timeout:g} s")
    except requests.exceptions.Timeout:
        return Sent(False, error=f"no answer within {timeout:g} s")
    except (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema, requests.exceptions.InvalidSchema):
        return Sent(False, error="the URL is not usable", permanent=True)
    except requests.exceptions.SSLError:
        return Sent(False, error="TLS handshake or certificate check failed")
    except requests.RequestException as exc:
        return Sent(False, error=f"could not connect ({_reason(exc)})")
    return classify_http(code, retry_after)


def classify_http(code: int, retry_after: str | None = None) -> Sent:
    if 200 <= code < 300:
        return Sent(True, status_code=code)
    if code in (408, 429) or 500 <= code < 600:
        return Sent(False, status_code=code, error=f"HTTP {code}", retry_after=parse_retry_after(retry_after))
    if 300 <= code < 400:
        return Sent(False, status_code=code, error=f"HTTP {code}: redirects are not followed", permanent=True)
    return Sent(False, status_code=code, error=f"HTTP {code}", permanent=True)


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds, or an HTTP date. None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


_ERRNO_TEXT = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


def _reason(exc: Exception) -> str:
    """A short cause without the URL (whose path or query may hold a token)."""
    found = _ERRNO_TEXT.search(str(exc))
    return found.group(1).strip() if found else type(exc).__name__


def _target_refused(channel: NotificationChannel, url: str) -> Sent | None:
    """A tenant's webhook may not reach the control plane's own network (loopback,
    private, link-local, …) unless HETEROFLOW_NOTIFY_ALLOW_PRIVATE_TARGETS says so; the
    operators' may. Checked against every address the name resolves to now."""
    if channel.tenant_id is None or settings.HETEROFLOW_NOTIFY_ALLOW_PRIVATE_TARGETS:
        return None
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        found = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError):
        return Sent(False, error="could not resolve the webhook's host name")
    for *_, sockaddr in found:
        address = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        if not address.is_global:
            return Sent(
                False,
                error="the webhook's host has a non-public address, which tenants' webhooks may not use",
                permanent=True,
            )
    return None


# --- e-mail ----------------------------------------------------------------------------------


def email_text(channel: NotificationChannel, delivery: NotificationDelivery) -> tuple[str, str]:
    alert = delivery.payload.get("alert")
    digest = delivery.payload.get("digest")
    if digest:
        return digest_text(channel, delivery, digest)
    if delivery.event == NotificationEvent.TEST or not alert:
        subject = f"Test notification for channel {channel.name}"
        lines = [delivery.payload.get("message", ""), ""]
    else:
        first_line = (alert["message"].splitlines() or [""])[0]
        if delivery.event == NotificationEvent.RAISED:
            subject = f"{alert['severity'].upper()} {alert['type']}: {first_line}"
        else:
            subject = f"{alert['state'].capitalize()}: {alert['type']}: {first_line}"
        lines = [alert["message"], ""]
        for label, key in (
            ("Type", "type"),
            ("Severity", "severity"),
            ("State", "state"),
            ("Scope", "scope"),
            ("Tenant", "tenant"),
            ("Node", "node_id"),
            ("GPU", "gpu_index"),
            ("Task", "task_id"),
            ("Raised at", "created_at"),
            ("Ended at", "ended_at"),
        ):
            if alert.get(key) is not None:
                lines.append(f"{label}: {alert[key]}")
        if alert.get("details"):
            lines.append("Details: " + json.dumps(alert["details"], sort_keys=True))
        lines.append("")
    lines.append(f"Event {delivery.event}, delivery {delivery.pk}, channel '{channel.name}'.")
    subject = " ".join((settings.EMAIL_SUBJECT_PREFIX + subject).split())[:200]  # one line
    return subject, "\n".join(lines) + "\n"


def digest_text(channel: NotificationChannel, delivery: NotificationDelivery, digest: dict) -> tuple[str, str]:
    """Many alerts in one e-mail (a storm, grouped by the dispatcher)."""
    what = "raised" if delivery.event == NotificationEvent.RAISED else "ended"
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(digest["types"].items()))
    subject = f"{digest['count']} alerts {what}: {kinds}"
    lines = [f"{digest['count']} alerts {what} in a few seconds ({kinds}).", ""]
    for alert in digest["alerts"]:
        lines.append(f"- {alert['severity'].upper()} {alert['type']}: {(alert['message'].splitlines() or [''])[0]}")
    if digest["omitted"]:
        lines.append(f"… and {digest['omitted']} more (see the alerts page).")
    lines += ["", f"Event {delivery.event}, delivery {delivery.pk}, channel '{channel.name}'."]
    subject = " ".join((settings.EMAIL_SUBJECT_PREFIX + subject).split())[:200]
    return subject, "\n".join(lines) + "\n"


def send_email(channel: NotificationChannel, delivery: NotificationDelivery) -> Sent:
    subject, text = email_text(channel, delivery)
    message = EmailMessage(
        subject,
        text,
        settings.DEFAULT_FROM_EMAIL,
        list(channel.recipients),
        headers={signing.EVENT_HEADER: delivery.event, signing.DELIVERY_HEADER: str(delivery.pk)},
    )
    try:
        message.send(fail_silently=False)
    except smtplib.SMTPRecipientsRefused as exc:  # every recipient refused
        codes = sorted({code for code, _ in exc.recipients.values()})
        return Sent(
            False,
            error=f"every recipient refused (SMTP {', '.join(map(str, codes))})",
            permanent=all(code >= 500 for code in codes),
        )
    except smtplib.SMTPResponseException as exc:
        return Sent(False, error=f"SMTP {exc.smtp_code}", permanent=exc.smtp_code >= 500)
    except (smtplib.SMTPException, OSError) as exc:
        return Sent(False, error=f"mail server unreachable ({_reason(exc)})")
    return Sent(True)
