from __future__ import annotations

from django_tenants.utils import schema_context

from apps.confidential.models import AuditEvent, Secret


def actor_name(principal) -> str:
    if principal is None:
        return "system"
    if principal.is_agent:
        return "agent"
    name = getattr(principal.user, "username", None) or "unknown"
    if principal.api_key is not None:
        return f"{name} (key {principal.api_key.display_prefix}…)"
    return name


def record_audit(tenant, principal, action: str, target: str = "", **details) -> None:
    with schema_context(tenant.schema_name):
        AuditEvent.objects.create(actor=actor_name(principal), action=action, target=target, details=details)


def put_secret(tenant, name: str, value: str, description: str = "") -> Secret:
    with schema_context(tenant.schema_name):
        secret, _ = Secret.objects.update_or_create(name=name, defaults={"value": value, "description": description})
        return secret


def read_secret(tenant, name: str) -> str | None:
    with schema_context(tenant.schema_name):
        return Secret.objects.filter(name=name).values_list("value", flat=True).first()
