"""Who may do what to shared rows, and which tenant a request acts for: the rules the API
views and the portal pages both apply, written once here so the two cannot drift.

The rules are judged by the principal's role in the row's tenant (apps.tenants.choices),
which is why they live in the tenants app: every app that owns shared rows (nodes, tasks,
alerts) and the portal already sit above it, so any of them can call these without an
import pointing up. The functions read only the attributes they name (`node.tenant_id`,
`task.tenant`, …), never the other apps' models.

`may_*` answer a question (a page shows or hides a button with it); `check_*` raise the
API's PermissionDenied with the words both surfaces show (the portal's `portal_page`
turns it into the page's 403). Scoping itself, what a principal may *see*, is
`Model.objects.visible_to` through apps.core.views."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from rest_framework.exceptions import PermissionDenied, ValidationError

from apps.core.views import get_visible_or_404, visible
from apps.tenants.choices import Role
from apps.tenants.models import Tenant

KEY_TENANT_REQUIRED = "Required: the slug of the tenant the key belongs to."
NODE_DELETE_REFUSED = "Only platform operators, or a tenant's admins for its dedicated nodes, can delete nodes."
TASK_CREATE_REFUSED = "Viewers cannot create tasks."
TASK_STOP_REFUSED = "Viewers cannot stop tasks."
MODEL_CHANGE_REFUSED = "Viewers cannot register, change or delete models."


# --- nodes --------------------------------------------------------------------------------


def may_delete_node(principal, node) -> bool:
    """Operators, or the tenant's admins for its own dedicated nodes (a shared node: operators only)."""
    return principal.is_operator or (node.tenant_id is not None and principal.has_tenant_role(node.tenant, Role.ADMIN))


def check_may_delete_node(principal, node) -> None:
    if not may_delete_node(principal, node):
        raise PermissionDenied(NODE_DELETE_REFUSED)


# --- tasks --------------------------------------------------------------------------------


def may_create_tasks(principal, tenant) -> bool:
    """Members and admins of the tenant (and operators); viewers only look."""
    return principal.is_operator or (tenant is not None and principal.has_tenant_role(tenant, Role.MEMBER))


def check_may_create_tasks(principal, tenant) -> None:
    if not may_create_tasks(principal, tenant):
        raise PermissionDenied(TASK_CREATE_REFUSED)


def may_stop_task(principal, task) -> bool:
    """As creating one: viewers cannot stop (or cancel) a task."""
    return principal.has_tenant_role(task.tenant, Role.MEMBER)


def check_may_stop_task(principal, task) -> None:
    if not may_stop_task(principal, task):
        raise PermissionDenied(TASK_STOP_REFUSED)


def may_enter_task(principal, task) -> bool:
    """A shell, an exec or a port of a running task (the tunnel): the tenant's members and
    admins, and operators; never viewers."""
    return principal.is_operator or principal.has_tenant_role(task.tenant, Role.MEMBER)


# --- models (the inference registry) ---------------------------------------------------


def may_manage_models(principal, tenant) -> bool:
    """Register, change and delete a tenant's models: as creating tasks (members, admins,
    operators); viewers only look."""
    return may_create_tasks(principal, tenant)


def check_may_manage_models(principal, tenant) -> None:
    if not may_manage_models(principal, tenant):
        raise PermissionDenied(MODEL_CHANGE_REFUSED)


# --- gateway endpoint keys -------------------------------------------------------------

ENDPOINT_KEY_CHANGE_REFUSED = "Viewers cannot create, change, rotate or revoke endpoint keys."


def may_manage_endpoint_keys(principal, tenant) -> bool:
    """Create, change, rotate and revoke a tenant's endpoint keys (sk-hf-): as creating
    tasks (members, admins, operators); viewers only look."""
    return may_create_tasks(principal, tenant)


def check_may_manage_endpoint_keys(principal, tenant) -> None:
    if not may_manage_endpoint_keys(principal, tenant):
        raise PermissionDenied(ENDPOINT_KEY_CHANGE_REFUSED)


# --- alerts and tenants --------------------------------------------------------------------


def may_resolve_alert(principal, alert) -> bool:
    """Operators any alert; a tenant's admins their tenant's (the only ones they see)."""
    return principal.is_operator or (
        alert.tenant_id is not None and principal.has_tenant_role(alert.tenant, Role.ADMIN)
    )


def may_manage_tenant(principal, tenant) -> bool:
    """Members, their roles and the audit log: the tenant's admins and operators."""
    return principal.has_tenant_role(tenant, Role.ADMIN)


# --- which tenant ------------------------------------------------------------------------


def tenant_by_slug(principal, slug: str) -> Tenant:
    """The tenant a URL (or a page's ?tenant=) names: 404 when it does not exist or is
    not the principal's, alike."""
    return get_visible_or_404(Tenant, principal, slug=slug)


def named_tenant(principal, slug: str, field: str = "tenant") -> Tenant:
    """A tenant named in a request's body: 400 on `field` when unknown. Another tenant's
    slug reads as unknown too: existence does not leak."""
    tenant = visible(Tenant, principal).filter(slug=slug).first()
    if tenant is None:
        raise ValidationError({field: [f"No tenant '{slug}'."]})
    return tenant


def acting_tenant(principal, slug: str | None, *, required: str) -> Tenant:
    """The tenant a request acts for (a task runs for, a key belongs to): the one named
    (404 outside scope), else the principal's own tenant (the one its key belongs to, or
    the one its session chose, by the X-HeteroFlow-Tenant header or the portal's switcher:
    apps.core.authentication). An operator has no tenant of its own and must name one:
    400 on `tenant` with `required`."""
    if slug is not None:
        return tenant_by_slug(principal, slug)
    if principal.is_tenant:
        return principal.tenant
    raise ValidationError({"tenant": [required]})


def key_owner(principal, username: str | None):
    """Whose key a request issues: the caller's own, or the named user's (400 on
    `username` when there is none; the services check who may issue for whom)."""
    if username is None:
        return principal.user
    owner = get_user_model().objects.filter(username=username).first()
    if owner is None:
        raise ValidationError({"username": [f"No user '{username}'."]})
    return owner
