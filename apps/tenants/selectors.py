from __future__ import annotations

import logging

from django.db import DatabaseError

from apps.tenants.models import Membership, TenantGroup

logger = logging.getLogger(__name__)


def tenants_may_share(tenant_a_id: int, tenant_b_id: int) -> bool:
    """Whether two tenants may occupy one physical GPU: the same tenant, or both in one
    tenant group. A failed lookup answers no (fail-closed)."""
    if tenant_a_id == tenant_b_id:
        return True
    try:
        return TenantGroup.objects.filter(tenants=tenant_a_id).filter(tenants=tenant_b_id).exists()
    except DatabaseError:
        logger.exception("tenant sharing lookup failed; refusing to share")
        return False


def membership_of(user, tenant) -> Membership | None:
    return Membership.objects.filter(user=user, tenant=tenant).first()


def admin_count(tenant) -> int:
    return Membership.objects.filter(tenant=tenant, role="admin").count()


def loses_last_admin(membership: Membership, new_role: str | None) -> bool:
    """Whether giving `membership` the role `new_role` (None: removing it) leaves its
    tenant without an admin."""
    return membership.role == "admin" and new_role != "admin" and admin_count(membership.tenant) <= 1
