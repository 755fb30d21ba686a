"""Every change to the gateway's tables: endpoint keys (create, change, rotate, revoke)
and tenant limits. Each change tells the gateway processes to drop what they cached
(`catalog.changed`, once the transaction commits).

A key's limits are its tenant's admins' to set, within the operator's bounds: the
tenant's limits (TenantLimits) and the platform's largest per-key limits
(HETEROFLOW_GATEWAY_KEY_MAX_*). A key limit above either is refused; an empty one means
"the bound" (admission holds every key to both, so a bound lowered later holds the keys
set above it before)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from rest_framework.exceptions import PermissionDenied, ValidationError

from apps.alerts import keys as alert_keys
from apps.alerts.choices import AlertScope, AlertType, Severity
from apps.alerts.services import raise_alert, recover_alert
from apps.confidential.services import record_audit
from apps.core.clock import utcnow
from apps.gateway import catalog, external, keys
from apps.gateway.models import EndpointKey, ExternalBackend, ServiceRoute, TenantLimits
from apps.inference.models import Model
from apps.tenants import policy

LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "concurrency_limit")
CHANGEABLE = ("name", "allowed_models", *LIMIT_FIELDS, "expires_at")
LIMIT_WORDS = {
    "rpm_limit": "requests per minute",
    "tpm_limit": "tokens per minute",
    "concurrency_limit": "concurrent requests",
}


@dataclass(frozen=True)
class IssuedEndpointKey:
    endpoint_key: EndpointKey
    key: str  # the plaintext, shown once


def _check_models(tenant, names) -> list[str]:
    """The allowed models, each a model the tenant registered (a typo would lock the key
    out of everything); duplicates dropped, order kept."""
    names = list(dict.fromkeys(names or []))
    known = set(Model.objects.filter(tenant=tenant, name__in=names).values_list("name", flat=True))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValidationError({"allowed_models": [f"No model named {name!r} in '{tenant.slug}'." for name in unknown]})
    return names


def key_limit_problems(tenant, limits: dict) -> dict[str, list[str]]:
    """Why the key limits given (field → value; None: none of its own) may not be set on a
    key of `tenant`: each above the tenant's limit or the platform's per-key maximum,
    with the smaller of the two named."""
    given = {field: value for field, value in limits.items() if field in LIMIT_FIELDS and value is not None}
    if not given:
        return {}
    tenant_limits = TenantLimits.objects.filter(tenant=tenant).first()
    problems = {}
    for field, value in given.items():
        tenants = getattr(tenant_limits, field) if tenant_limits is not None else None
        platform = getattr(settings, catalog.KEY_MAX_SETTINGS[field])
        words = LIMIT_WORDS[field]
        if tenants is not None and value > tenants and (platform is None or tenants <= platform):
            problems[field] = [
                f"At most {tenants}: the tenant's limit of {words}, set by the platform's operators. "
                "Leave it empty for the tenant's limit."
            ]
        elif platform is not None and value > platform:
            problems[field] = [
                f"At most {platform}: the platform's largest {words} per key "
                f"({catalog.KEY_MAX_SETTINGS[field]}). Leave it empty for the maximum."
            ]
    return problems


def _check_key_limits(tenant, limits: dict) -> None:
    problems = key_limit_problems(tenant, limits)
    if problems:
        raise ValidationError(problems)


def create_key(
    principal,
    *,
    tenant,
    name: str,
    allowed_models=(),
    rpm_limit: int | None = None,
    tpm_limit: int | None = None,
    concurrency_limit: int | None = None,
    expires_at: datetime | None = None,
) -> IssuedEndpointKey:
    policy.check_may_manage_endpoint_keys(principal, tenant)
    allowed = _check_models(tenant, allowed_models)
    _check_key_limits(tenant, {"rpm_limit": rpm_limit, "tpm_limit": tpm_limit, "concurrency_limit": concurrency_limit})
    key = keys.generate()
    with transaction.atomic():
        endpoint_key = EndpointKey.objects.create(
            tenant=tenant,
            name=name,
            key_hash=keys.hash_key(key),
            display_prefix=keys.display_prefix(key),
            allowed_models=allowed,
            rpm_limit=rpm_limit,
            tpm_limit=tpm_limit,
            concurrency_limit=concurrency_limit,
            expires_at=expires_at,
            created_by=principal.user if getattr(principal.user, "pk", None) else None,
        )
        record_audit(tenant, principal, "endpoint_key.created", endpoint_key.display_prefix, name=name)
        catalog.changed()
    return IssuedEndpointKey(endpoint_key, key)


def update_key(principal, endpoint_key: EndpointKey, **fields) -> EndpointKey:
    policy.check_may_manage_endpoint_keys(principal, endpoint_key.tenant)
    unknown = set(fields) - set(CHANGEABLE)
    if unknown:
        raise ValueError(f"not changeable: {sorted(unknown)}")
    if endpoint_key.revoked_at is not None:
        raise ValidationError({"non_field_errors": ["A revoked key cannot be changed."]})
    if "allowed_models" in fields:
        fields["allowed_models"] = _check_models(endpoint_key.tenant, fields["allowed_models"])
    _check_key_limits(endpoint_key.tenant, fields)  # only the limits changed: one set above a bound lowered since stays
    with transaction.atomic():
        EndpointKey.objects.filter(pk=endpoint_key.pk).update(**fields)
        record_audit(
            endpoint_key.tenant,
            principal,
            "endpoint_key.changed",
            endpoint_key.display_prefix,
            fields=sorted(fields),
        )
        catalog.changed()
    endpoint_key.refresh_from_db()
    return endpoint_key


def rotate_key(principal, endpoint_key: EndpointKey, *, grace_seconds: int | None = None) -> IssuedEndpointKey:
    """A new secret for the key; the current one stays valid for `grace_seconds` (the
    setting's default), then only the new one works. A secret still in its grace period
    from an earlier rotation stops working now: a key has at most two."""
    policy.check_may_manage_endpoint_keys(principal, endpoint_key.tenant)
    grace = settings.HETEROFLOW_GATEWAY_ROTATE_GRACE_SECONDS if grace_seconds is None else grace_seconds
    key = keys.generate()
    now = utcnow()
    with transaction.atomic():
        updated = EndpointKey.objects.filter(
            pk=endpoint_key.pk, revoked_at__isnull=True, key_hash=endpoint_key.key_hash
        ).update(
            previous_key_hash=endpoint_key.key_hash if grace > 0 else None,
            previous_display_prefix=endpoint_key.display_prefix if grace > 0 else "",
            previous_valid_until=now + timedelta(seconds=grace) if grace > 0 else None,
            key_hash=keys.hash_key(key),
            display_prefix=keys.display_prefix(key),
            rotated_at=now,
        )
        if not updated:
            endpoint_key.refresh_from_db()
            if endpoint_key.revoked_at is not None:
                raise ValidationError({"non_field_errors": ["A revoked key cannot be rotated."]})
            raise ValidationError({"non_field_errors": ["The key was rotated meanwhile; read it again."]})
        record_audit(
            endpoint_key.tenant,
            principal,
            "endpoint_key.rotated",
            keys.display_prefix(key),
            previous=endpoint_key.display_prefix,
            grace_seconds=grace,
        )
        catalog.changed()
    endpoint_key.refresh_from_db()
    return IssuedEndpointKey(endpoint_key, key)


def revoke_key(principal, endpoint_key: EndpointKey) -> EndpointKey:
    """Both secrets stop working at once (in every gateway process within the catalog's
    check interval). Revoking twice is a no-op."""
    policy.check_may_manage_endpoint_keys(principal, endpoint_key.tenant)
    if endpoint_key.revoked_at is None:
        with transaction.atomic():
            EndpointKey.objects.filter(pk=endpoint_key.pk, revoked_at__isnull=True).update(revoked_at=utcnow())
            record_audit(endpoint_key.tenant, principal, "endpoint_key.revoked", endpoint_key.display_prefix)
            catalog.changed()
        endpoint_key.refresh_from_db()
    return endpoint_key


def set_tenant_limits(principal, tenant, **limits) -> TenantLimits:
    """A tenant's limits over all its keys: operators only. Lowering one below a key's
    own needs no change to the key: admission holds every request to both."""
    if not principal.is_operator:
        raise PermissionDenied("Only platform operators set a tenant's gateway limits.")
    unknown = set(limits) - set(LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"not limits: {sorted(unknown)}")
    with transaction.atomic():
        row, _ = TenantLimits.objects.update_or_create(tenant=tenant, defaults=limits)
        catalog.changed()
    return row


def set_service_route(principal, service, *, priority: int | None = None, weight: int | None = None):
    """A service's share of its model name (priority, weight): as changing the service
    (members and admins of its tenant, operators)."""
    policy.check_may_manage_endpoint_keys(principal, service.group.tenant)
    values = {name: value for name, value in (("priority", priority), ("weight", weight)) if value is not None}
    with transaction.atomic():
        route, _ = ServiceRoute.objects.update_or_create(service=service, defaults=values)
        catalog.changed()
    return route


def _own_hosts() -> list[str]:
    hosts = list(settings.ALLOWED_HOSTS)
    if settings.HETEROFLOW_PUBLIC_URL:
        hosts.append(urlsplit(settings.HETEROFLOW_PUBLIC_URL).hostname or "")
    return hosts


def check_external_url(url: str) -> str:
    problems = external.url_problems(
        url, allowed=settings.HETEROFLOW_GATEWAY_EXTERNAL_ALLOWED, own_hosts=_own_hosts(), resolve=external.resolve
    )
    if problems:
        raise ValidationError({"base_url": problems})
    return url


EXTERNAL_FIELDS = ("model", "base_url", "secret_name", "priority", "weight", "enabled")


def declare_external_backend(principal, *, tenant, **fields) -> ExternalBackend:
    """An operator puts an existing OpenAI-compatible server behind a tenant's keys."""
    if not principal.is_operator:
        raise PermissionDenied("Only platform operators declare external backends.")
    unknown = set(fields) - set(EXTERNAL_FIELDS)
    if unknown:
        raise ValueError(f"not fields of an external backend: {sorted(unknown)}")
    check_external_url(fields["base_url"])
    with transaction.atomic():
        backend = ExternalBackend.objects.create(
            tenant=tenant, created_by=principal.user if getattr(principal.user, "pk", None) else None, **fields
        )
        record_audit(tenant, principal, "external_backend.declared", backend.model, base_url=backend.base_url)
        catalog.changed()
    return backend


def change_external_backend(principal, backend: ExternalBackend, **fields) -> ExternalBackend:
    if not principal.is_operator:
        raise PermissionDenied("Only platform operators change external backends.")
    if "base_url" in fields:
        check_external_url(fields["base_url"])
    with transaction.atomic():
        ExternalBackend.objects.filter(pk=backend.pk).update(**fields)
        record_audit(backend.tenant, principal, "external_backend.changed", backend.model, fields=sorted(fields))
        catalog.changed()
    backend.refresh_from_db()
    return backend


def remove_external_backend(principal, backend: ExternalBackend) -> None:
    if not principal.is_operator:
        raise PermissionDenied("Only platform operators remove external backends.")
    with transaction.atomic():
        backend.delete()
        record_audit(backend.tenant, principal, "external_backend.removed", backend.model)
        catalog.changed()


# --- Redis away under the gateway ----------------------------------------------------------

WITHOUT_REDIS = {
    "local": "each gateway process holds its share of every key's and tenant's limit",
    "closed": "the gateway answers 503 to every request that needs a limit checked",
    "open": "the gateway admits every request with no limit at all",
}


def redis_away(mode: str) -> bool:
    """GATEWAY_REDIS_AWAY (one for the cluster): the shared limits cannot be read. Returns
    whether a new alert was raised."""
    return raise_alert(
        type=AlertType.GATEWAY_REDIS_AWAY,
        severity=Severity.CRITICAL if mode == "open" else Severity.ERROR,
        scope=AlertScope.CLUSTER,
        key=alert_keys.GATEWAY_REDIS_AWAY,
        details={"mode": mode},
        message=f"The gateway cannot reach Redis: {WITHOUT_REDIS[mode]} until it is back.",
    )


def redis_back() -> bool:
    """Redis answers a gateway process again: the shared limits hold once more."""
    return recover_alert(alert_keys.GATEWAY_REDIS_AWAY)
