"""Scoping by default (issue 29, point 10): every model with a foreign key to the tenant
inherits apps.core.models.TenantOwned, so its default manager is scoped and
`visible_to(principal)` is there for it. A new model that forgets fails here, naming it."""

from __future__ import annotations

import pytest
from django.apps import apps
from django.conf import settings

from apps.core.models import TenantOwned
from apps.core.principals import Principal, PrincipalKind
from apps.core.scoping import ScopedQuerySet
from apps.tenants.choices import Role
from apps.tenants.models import Tenant

# Models with a tenant foreign key that must not be scoped, each with why. Empty: even
# django-tenants' Domain is scoped (a tenant principal sees only its own domains).
NOT_TENANT_OWNED: dict[str, str] = {}


def tenant_keys(model) -> list[str]:
    """The forward foreign keys and one-to-ones of `model` to the tenant model."""
    tenant = apps.get_model(settings.TENANT_MODEL)
    return [
        field.name
        for field in model._meta.get_fields()
        if (field.many_to_one or field.one_to_one)
        and not field.auto_created
        and field.concrete
        and field.related_model is tenant
    ]


def tenant_owned_models() -> list:
    return [model for model in apps.get_models() if tenant_keys(model)]


def test_the_walk_finds_the_known_tenant_tables():
    labels = {model._meta.label for model in tenant_owned_models()}
    # the three that had a plain manager before, and two that always had a scoped one
    known = {"tasks.UsageRecord", "scheduler.GpuAllocation", "gateway.TenantLimits", "tasks.Task", "nodes.Node"}
    assert known <= labels


def test_every_model_with_a_tenant_key_is_tenant_owned():
    problems = []
    for model in tenant_owned_models():
        label = model._meta.label
        if label in NOT_TENANT_OWNED:
            continue
        if not issubclass(model, TenantOwned):
            keys = ", ".join(tenant_keys(model))
            problems.append(f"{label} has a tenant key ({keys}) but does not inherit apps.core.models.TenantOwned")
        elif not isinstance(model._default_manager.get_queryset(), ScopedQuerySet):
            problems.append(f"{label}'s default manager ({model._default_manager.name}) is not a ScopedQuerySet's")
    assert not problems, "\n".join(problems)


def test_the_allow_list_names_only_models_that_need_it():
    stale = [label for label in NOT_TENANT_OWNED if not tenant_keys(apps.get_model(label))]
    assert not stale, f"NOT_TENANT_OWNED names models without a tenant key: {stale}"


def test_tenant_owned_adds_no_field():
    assert not TenantOwned._meta.local_fields


@pytest.mark.parametrize("label", sorted(model._meta.label for model in tenant_owned_models()))
def test_a_tenant_principal_sees_only_its_own_rows(label):
    model = apps.get_model(label)
    tenant = Tenant(pk=41, slug="acme", schema_name="acme")
    principal = Principal(PrincipalKind.TENANT_KEY, tenant=tenant, role=Role.ADMIN)
    sql = str(model.objects.visible_to(principal).query)
    assert '"tenant_id" = 41' in sql, sql
    assert model.objects.visible_to(Principal(PrincipalKind.NO_TENANT)).query.is_empty()
