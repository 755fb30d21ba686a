"""The one scoping entry point for shared tables.

Every API view and page reads shared rows through `Model.objects.visible_to(principal)`.
Rows outside the principal's scope are simply absent, so a lookup answers 404 and never
reveals that the row exists.
"""

from __future__ import annotations

from django.db import models


class ScopedQuerySet(models.QuerySet):
    # The lookup from this model to its owning tenant; "pk" on the tenant model itself.
    tenant_field: str = "tenant"

    def visible_to(self, principal):
        if principal is None:
            return self.none()
        if principal.is_operator:
            return self.all()
        if principal.is_tenant:
            return self.filter(**{self.tenant_field: principal.tenant.pk})
        return self.none()
