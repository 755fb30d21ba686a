from __future__ import annotations

from django_tenants.utils import schema_context

from apps.confidential.models import AuditEvent, Secret
from apps.core.audit import actor_name, note_recorded, record_operator_audit


def record_audit(tenant, principal, action: str, target: str = "", **details) -> None:
    """A change in `tenant`, in its own log; a change an operator made, in the operators'
    log as well. The request that made it is then not recorded again (apps.core.audit)."""
    with schema_context(tenant.schema_name):
        AuditEvent.objects.create(actor=actor_name(principal), action=action, target=target, details=details)
    if getattr(principal, "is_operator", False):
        record_operator_audit(principal, action, target, tenant.slug, **details)
    note_recorded()


def put_secret(tenant, name: str, value: str, description: str = "") -> Secret:
    with schema_context(tenant.schema_name):
        secret, _ = Secret.objects.update_or_create(name=name, defaults={"value": value, "description": description})
        return secret


def read_secret(tenant, name: str) -> str | None:
    with schema_context(tenant.schema_name):
        return Secret.objects.filter(name=name).values_list("value", flat=True).first()
