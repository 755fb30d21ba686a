"""Every state change of tenancy: tenants, members, API keys, quotas, tenant groups."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import Q
from rest_framework.exceptions import PermissionDenied, ValidationError

from apps.confidential.services import record_audit
from apps.core import locks
from apps.core.clock import utcnow
from apps.core.errors import Conflict
from apps.tasks.choices import ACTIVE
from apps.tasks.models import Task, TenantUsage
from apps.tenants import keys
from apps.tenants.choices import ROLE_RANK, KeyScope, Role
from apps.tenants.error_codes import TenantErrorCode
from apps.tenants.models import ApiKey, Membership, Tenant, TenantGroup
from apps.tenants.selectors import loses_last_admin, membership_of

User = get_user_model()
SCHEMA_PREFIX = "t_"


def schema_name_for(slug: str) -> str:
    return SCHEMA_PREFIX + slug.replace("-", "_")


# --- tenants ---------------------------------------------------------------------------


# what an operator sets on a tenant beside its name: its quotas and its interactive
# tasks' idle times (docs/interactive.md)
LIMIT_FIELDS = (
    "max_gpus",
    "max_gpu_memory_mb",
    "max_concurrent_tasks",
    "interactive_idle_minutes",
    "interactive_idle_minutes_max",
)


def create_tenant(*, name: str, slug: str, principal=None, **limits) -> Tenant:
    """Create the tenant and its schema (migrated) in one transaction."""
    unknown = set(limits) - set(LIMIT_FIELDS)
    if unknown:
        raise TypeError(f"create_tenant() got unexpected fields: {', '.join(sorted(unknown))}")
    if Tenant.objects.filter(Q(slug=slug) | Q(name__iexact=name)).exists():
        raise Conflict(f"A tenant named '{name}' or with slug '{slug}' already exists.", TenantErrorCode.TENANT_EXISTS)
    try:
        with transaction.atomic():
            tenant = Tenant(name=name, slug=slug, schema_name=schema_name_for(slug), **limits)
            tenant.save(verbosity=0)
            record_audit(tenant, principal, "tenant.created", slug, name=name)
    except IntegrityError:
        # Lost a race with a concurrent create of the same name or slug.
        raise Conflict(
            f"A tenant named '{name}' or with slug '{slug}' already exists.", TenantErrorCode.TENANT_EXISTS
        ) from None
    return tenant


def update_tenant(tenant: Tenant, *, principal=None, **changes) -> Tenant:
    if "name" in changes and Tenant.objects.exclude(pk=tenant.pk).filter(name__iexact=changes["name"]).exists():
        raise Conflict(f"A tenant named '{changes['name']}' already exists.", TenantErrorCode.TENANT_EXISTS)
    with transaction.atomic():
        for field, value in changes.items():
            setattr(tenant, field, value)
        tenant.save(update_fields=list(changes) or None)
        record_audit(tenant, principal, "tenant.updated", tenant.slug, **{k: str(v) for k, v in changes.items()})
    return tenant


def delete_tenant(tenant: Tenant) -> None:
    """Delete the tenant, its schema and everything it owns; refused while any task is active.
    The tenant's usage row, locked as task creation locks it, makes the check and the
    delete atomic against task creation."""
    with transaction.atomic():
        TenantUsage.objects.locked(tenant.pk)
        active = list(
            Task.objects.filter(tenant=tenant, status__in=ACTIVE).order_by("id").values_list("id", "status")[:20]
        )
        if active:
            listed = ", ".join(f"#{task_id} ({status})" for task_id, status in active)
            raise Conflict(
                f"Tenant '{tenant.slug}' has active tasks: {listed}. Stop or cancel them first.",
                TenantErrorCode.TENANT_HAS_ACTIVE_TASKS,
            )
        dedicated = list(tenant.dedicated_nodes.order_by("id").values_list("id", flat=True)[:20])
        if dedicated:
            raise Conflict(
                f"Tenant '{tenant.slug}' has dedicated nodes: {', '.join(dedicated)}. "
                "Make them shared or assign them elsewhere first.",
                TenantErrorCode.TENANT_HAS_DEDICATED_NODES,
            )
        tenant.delete()


# --- members ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberAdded:
    membership: Membership
    user_created: bool
    initial_password: str | None  # shown once, only when we generated it


def add_member(
    tenant: Tenant,
    *,
    username: str,
    email: str = "",
    role: str = Role.MEMBER,
    password: str | None = None,
    principal=None,
) -> MemberAdded:
    with transaction.atomic():
        user = User.objects.filter(username=username).first()
        created, generated = False, None
        if user is None:
            if password is None:
                generated = password = secrets.token_urlsafe(12)
            user = User.objects.create_user(username=username, email=email, password=password)
            created = True
        elif password is not None:
            raise ValidationError({"password": ["The user exists already; their password is not changed here."]})
        if Membership.objects.filter(user=user, tenant=tenant).exists():
            raise Conflict(f"'{username}' is already a member of '{tenant.slug}'.", TenantErrorCode.ALREADY_MEMBER)
        membership = Membership.objects.create(user=user, tenant=tenant, role=role)
        record_audit(tenant, principal, "member.added", username, role=role, user_created=created)
    return MemberAdded(membership, created, generated)


def _refuse_losing_last_admin(membership: Membership, new_role: str | None) -> None:
    if loses_last_admin(membership, new_role):
        raise Conflict(
            f"'{membership.user.username}' is the last admin of '{membership.tenant.slug}'; "
            "make someone else admin first.",
            TenantErrorCode.LAST_ADMIN,
        )


def change_member_role(membership: Membership, role: str, *, principal=None, keep_an_admin: bool = True) -> Membership:
    """keep_an_admin=False: the company's directory decides (apps.identity), and a tenant
    whose last admin lost the group is left to its operators rather than to that person."""
    with transaction.atomic():
        locks.xact_lock(locks.tenant_lock_key(membership.tenant_id))
        if keep_an_admin:
            _refuse_losing_last_admin(membership, role)
        membership.role = role
        membership.save(update_fields=["role"])
        record_audit(membership.tenant, principal, "member.role_changed", membership.user.username, role=role)
    return membership


def remove_member(membership: Membership, *, principal=None, keep_an_admin: bool = True) -> None:
    with transaction.atomic():
        locks.xact_lock(locks.tenant_lock_key(membership.tenant_id))
        if keep_an_admin:
            _refuse_losing_last_admin(membership, None)
        tenant, user = membership.tenant, membership.user
        # A member's keys act as that member; without the membership they must die too.
        ApiKey.objects.filter(tenant=tenant, user=user, revoked_at__isnull=True).update(revoked_at=utcnow())
        membership.delete()
        record_audit(tenant, principal, "member.removed", user.username)


# --- API keys --------------------------------------------------------------------------


@dataclass(frozen=True)
class IssuedKey:
    api_key: ApiKey
    key: str  # the plaintext, shown once


def _store_key(*, scope, user, name, tenant=None, role="", expires_at=None, key=None) -> IssuedKey:
    key = key or keys.generate(scope)
    api_key = ApiKey.objects.create(
        scope=scope,
        tenant=tenant,
        user=user,
        role=role,
        name=name,
        key_hash=keys.hash_key(key),
        display_prefix=keys.display_prefix(key),
        expires_at=expires_at,
    )
    return IssuedKey(api_key, key)


def issue_platform_key(*, user, name: str, expires_at: datetime | None = None, key: str | None = None) -> IssuedKey:
    if not user.is_staff:
        raise ValidationError({"user": ["Platform keys belong to platform operators (staff users)."]})
    return _store_key(scope=KeyScope.PLATFORM, user=user, name=name, expires_at=expires_at, key=key)


def issue_tenant_key(
    *, principal, tenant: Tenant, owner, name: str, role: str | None = None, expires_at: datetime | None = None
) -> IssuedKey:
    """A key acts as its owner, a member of `tenant`, with at most the owner's role.
    Operators and the tenant's admins issue keys for any member; others only for themselves."""
    if not (principal.is_operator or principal.is_tenant_admin or owner.pk == principal.user.pk):
        raise PermissionDenied("Only tenant admins can issue keys for other members.")
    membership = membership_of(owner, tenant)
    if membership is None:
        raise ValidationError({"username": [f"'{owner.username}' is not a member of '{tenant.slug}'."]})
    ceiling = membership.role
    if principal.is_tenant and ROLE_RANK[Role(principal.role)] < ROLE_RANK[Role(ceiling)]:
        # A key limited below its owner's role must not mint a stronger one.
        ceiling = principal.role
    role = role or ceiling
    if ROLE_RANK[Role(role)] > ROLE_RANK[Role(ceiling)]:
        raise ValidationError({"role": [f"A key issued here can be at most {ceiling}, not {role}."]})
    with transaction.atomic():
        issued = _store_key(
            scope=KeyScope.TENANT, user=owner, name=name, tenant=tenant, role=role, expires_at=expires_at
        )
        record_audit(
            tenant, principal, "api_key.issued", issued.api_key.display_prefix, owner=owner.username, role=role
        )
    return issued


def revoke_key(api_key: ApiKey, *, principal) -> ApiKey:
    if not (
        principal.is_operator
        or (principal.is_tenant_admin and api_key.tenant_id == principal.tenant.pk)
        or api_key.user_id == principal.user.pk
    ):
        raise PermissionDenied("Only the key's owner, the tenant's admins or operators can revoke it.")
    if api_key.revoked_at is None:
        with transaction.atomic():
            ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=utcnow())
            if api_key.tenant_id:
                record_audit(api_key.tenant, principal, "api_key.revoked", api_key.display_prefix)
        api_key.refresh_from_db()
    return api_key


# --- tenant groups ---------------------------------------------------------------------


def save_group(group: TenantGroup | None, *, name: str, description: str = "", tenants=None) -> TenantGroup:
    with transaction.atomic():
        group = group or TenantGroup()
        group.name, group.description = name, description
        try:
            with transaction.atomic():
                group.save()
        except IntegrityError:
            raise Conflict(f"A tenant group named '{name}' already exists.", TenantErrorCode.GROUP_EXISTS) from None
        if tenants is not None:
            group.tenants.set(tenants)
    return group
