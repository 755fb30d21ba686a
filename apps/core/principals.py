"""Who is calling. Every authenticated request carries one Principal in `request.auth`."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from apps.tenants.choices import Role, role_at_least

if TYPE_CHECKING:
    from apps.tenants.models import ApiKey, Tenant


class PrincipalKind(enum.StrEnum):
    OPERATOR = "operator"  # platform operator: staff session or sk-admin- key
    TENANT_USER = "tenant_user"  # a person signed in, acting in one tenant
    TENANT_KEY = "tenant_key"  # sk-tenant- key of one member
    AGENT = "agent"  # node agents' shared infrastructure secret
    NO_TENANT = "no_tenant"  # signed in, but member of no tenant: can act on nothing


@dataclass(frozen=True)
class Principal:
    kind: PrincipalKind
    user: Any = None
    tenant: Tenant | None = None
    role: Role | None = None
    api_key: ApiKey | None = None

    @property
    def is_operator(self) -> bool:
        return self.kind == PrincipalKind.OPERATOR

    @property
    def is_agent(self) -> bool:
        return self.kind == PrincipalKind.AGENT

    @property
    def is_tenant(self) -> bool:
        return self.kind in (PrincipalKind.TENANT_USER, PrincipalKind.TENANT_KEY)

    @property
    def is_tenant_admin(self) -> bool:
        return self.is_tenant and self.role == Role.ADMIN

    def has_tenant_role(self, tenant, minimum: Role) -> bool:
        """Operators may do anything; tenant principals need `minimum` in that tenant."""
        if self.is_operator:
            return True
        return self.is_tenant and self.tenant.pk == tenant.pk and role_at_least(self.role, minimum)


AGENT = Principal(PrincipalKind.AGENT)
