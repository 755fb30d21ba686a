"""Every state change of identity: the group mappings, and what a sign-in through the
company's directory does to its person (docs/identity.md#mapping).

A sign-in through OpenID Connect or LDAP brings the person's directory groups. The
mappings turn them into entitlements (a role in each mapped tenant, the highest one when
several groups map to the same tenant; platform operator), and `sign_in` makes the
person's memberships exactly those, through the tenants app's own writers
(add_member, change_member_role, remove_member: a removed membership's keys are revoked
there, and every key is checked against its membership at each request anyway). A person
with no mapped group is refused, and loses what they had.

Lock order: one person's memberships, tenant by tenant in tenant id order, each under its
tenant's advisory lock (the tenants app's writers take it); the directory identity row
(FOR UPDATE) before them. The mapping table is replaced whole under one advisory lock.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass
from types import SimpleNamespace

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models.functions import Lower

from apps.core import locks
from apps.core.audit import record_operator_audit
from apps.core.clock import utcnow
from apps.identity.models import DirectoryIdentity, GroupMapping
from apps.tenants import services as tenancy
from apps.tenants.choices import ROLE_RANK, Role
from apps.tenants.models import Membership, Tenant

User = get_user_model()
logger = logging.getLogger("heteroflow.security")

MAPPINGS_LOCK = "identity:mappings"
USERNAME_MAX = 150  # Django's
USERNAME_CLEAN = re.compile(r"[^\w.@+-]")
# a backend of the sign-in form (LDAP) that refused a person leaves the reason here on the
# request, for the page to say (apps.portal.login)
REFUSAL_ATTRIBUTE = "heteroflow_identity_refusal"


@dataclass(frozen=True)
class DirectoryAccount:
    """What a directory says about the person signing in."""

    source: str  # "oidc:<provider>" or "ldap"
    subject: str  # the OIDC `sub`, or the LDAP user name
    username: str  # the name they would like (preferred_username, the LDAP uid)
    email: str = ""
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class Entitlements:
    operator: bool
    roles: dict[int, str]  # tenant id → role

    @property
    def empty(self) -> bool:
        return not self.operator and not self.roles


class SignInRefused(Exception):
    """No mapped group (or a disabled account): the sign-in page says so, with a 403."""

    def __init__(self, account: DirectoryAccount, reason: str):
        super().__init__(reason)
        self.account = account
        self.reason = reason


@dataclass(frozen=True)
class DirectoryActor:
    """Who the audit log names for what a sign-in changes: the directory, by source."""

    source: str
    is_operator: bool = False

    @property
    def user(self):
        return SimpleNamespace(username=f"directory ({self.source})")


# --- mappings ------------------------------------------------------------------------


def entitlements_for(groups) -> Entitlements:
    """The mappings of `groups` (compared without case: LDAP DNs are case-insensitive, and
    no directory tells two groups apart by case alone)."""
    wanted = {group.lower() for group in groups if group}
    if not wanted:
        return Entitlements(False, {})
    operator, roles = False, {}
    for mapping in GroupMapping.objects.annotate(key=Lower("group")).filter(key__in=wanted):
        if mapping.operator:
            operator = True
        elif ROLE_RANK[Role(mapping.role)] > ROLE_RANK.get(roles.get(mapping.tenant_id), -1):
            roles[mapping.tenant_id] = mapping.role
    return Entitlements(operator, roles)


def replace_mappings(rows: list[dict], *, principal) -> list[GroupMapping]:
    """The whole table at once, as PUT /api/v1/admin/identity/mappings sends it: each row
    {"group", "tenant" (a Tenant or None), "role", "operator"}, checked by its serializer."""
    with transaction.atomic():
        locks.xact_lock(MAPPINGS_LOCK)
        GroupMapping.objects.all().delete()
        created = GroupMapping.objects.bulk_create(
            GroupMapping(
                group=row["group"],
                tenant=row.get("tenant"),
                role=row.get("role") or "",
                operator=bool(row.get("operator")),
            )
            for row in rows
        )
        record_operator_audit(
            principal, "identity.mappings_replaced", "mappings", mappings=[str(mapping) for mapping in created]
        )
    return list(GroupMapping.objects.select_related("tenant").order_by("group", "tenant__name"))


# --- sign-in ---------------------------------------------------------------------------


def sign_in(account: DirectoryAccount, *, user=None):
    """The user `account` signs in as, their memberships and operator flag made what the
    mappings give their groups; created on a first sign-in (audited). `user`: the account
    the LDAP backend found or made for the same name. Raises SignInRefused, after the
    person lost what they had, when no group is mapped or the account is disabled."""
    granted = entitlements_for(account.groups)
    with transaction.atomic():
        identity = (
            DirectoryIdentity.objects.select_for_update()
            .select_related("user")
            .filter(source=account.source, subject=account.subject)
            .first()
        )
        if identity is not None:
            user = identity.user
        refusal = None
        if user is not None and not user.is_active:
            refusal = "Your account is disabled here. Ask a platform operator."
        elif granted.empty:
            refusal = "None of your directory groups gives access to HeteroFlow. Ask a platform operator to map one."
        if refusal is None and user is None:
            user = _create_user(account)
        if user is not None:
            identity = _remember(identity, user, account)
            _apply(user, Entitlements(False, {}) if refusal else granted, DirectoryActor(account.source))
        if refusal:
            record_operator_audit(
                None,
                "identity.sign_in_refused",
                account.username,
                source=account.source,
                subject=account.subject,
                groups=list(account.groups),
                reason=refusal,
            )
    if refusal:
        logger.warning("directory sign-in refused for %r (%s): %s", account.username, account.source, refusal)
        raise SignInRefused(account, refusal)
    return user


def _create_user(account: DirectoryAccount):
    user = User(username=_free_username(account), email=account.email)
    user.set_unusable_password()  # the directory checks who they are, never a password here
    user.save()
    record_operator_audit(None, "identity.user_created", user.username, source=account.source, subject=account.subject)
    return user


def _free_username(account: DirectoryAccount) -> str:
    """The name the directory suggests, unless a user has it already (a local account of
    the same name is never taken over): then with the source after it."""
    base = USERNAME_CLEAN.sub("", account.username or account.email.split("@")[0] or "")[:100] or "user"
    candidates = [base, f"{base}@{account.source.split(':')[-1]}"]
    for candidate in candidates:
        if not User.objects.filter(username__iexact=candidate).exists():
            return candidate
    return f"{candidates[-1]}-{secrets.token_hex(3)}"


def _remember(identity, user, account: DirectoryAccount) -> DirectoryIdentity:
    if identity is None:
        identity = DirectoryIdentity(user=user, source=account.source, subject=account.subject)
    identity.groups = list(account.groups)
    identity.last_sign_in_at = utcnow()
    identity.save()
    return identity


def _apply(user, granted: Entitlements, actor: DirectoryActor) -> None:
    current = {m.tenant_id: m for m in Membership.objects.filter(user=user).select_related("tenant", "user")}
    for tenant_id in sorted(set(current) | set(granted.roles)):
        membership, role = current.get(tenant_id), granted.roles.get(tenant_id)
        if membership is None:
            tenancy.add_member(Tenant.objects.get(pk=tenant_id), username=user.username, role=role, principal=actor)
        elif role is None:
            tenancy.remove_member(membership, principal=actor, keep_an_admin=False)
        elif membership.role != role:
            tenancy.change_member_role(membership, role, principal=actor, keep_an_admin=False)
    if bool(user.is_staff) != granted.operator:
        # a platform operator is a staff user (apps.core.principals); the admin wants
        # superuser for its models, as `manage.py bootstrap` makes the first operator
        user.is_staff = user.is_superuser = granted.operator
        user.save(update_fields=["is_staff", "is_superuser"])
        action = "identity.operator_granted" if granted.operator else "identity.operator_revoked"
        record_operator_audit(actor, action, user.username)
