"""Who changed what: the plumbing of the audit log (docs/security.md#audit-log).

Every change a person makes (an operator, a tenant's admin, member or key) is recorded
once: either explicitly by the service that makes it, with a meaningful action
(`apps.confidential.services.record_audit`: "api_key.created"), or, for every other
change, by the request itself (`apps.confidential.middleware.AuditMiddleware`: "POST
/api/v1/tasks/<int:pk>/stop"). A request during which a service recorded its change is
not recorded again: `note_recorded` marks it for the request's context.

Changes in one tenant go to that tenant's log (in its schema, read by its admins);
changes by operators also go to the operators' log (`OperatorAuditEvent`, in public).
"""

from __future__ import annotations

from contextvars import ContextVar

from apps.core.models import OperatorAuditEvent

_recorded: ContextVar[bool] = ContextVar("audit_recorded", default=False)


def begin():
    """At the start of a request that may change something; returns the token for `end`."""
    return _recorded.set(False)


def end(token) -> None:
    _recorded.reset(token)


def note_recorded() -> None:
    _recorded.set(True)


def was_recorded() -> bool:
    return _recorded.get()


def actor_name(principal) -> str:
    """The actor as the log keeps it: the person's user name, with the key's prefix when
    a key acted; "system" for the platform's own jobs."""
    if principal is None:
        return "system"
    if getattr(principal, "is_agent", False):
        return "agent"
    name = getattr(getattr(principal, "user", None), "username", None) or "unknown"
    key = getattr(principal, "api_key", None)
    if key is not None:
        return f"{name} (key {key.display_prefix}…)"
    return name


def record_operator_audit(principal, action: str, target: str = "", tenant: str = "", **details) -> None:
    OperatorAuditEvent.objects.create(
        actor=actor_name(principal), action=action[:200], target=str(target)[:200], tenant=tenant, details=details
    )
    note_recorded()
