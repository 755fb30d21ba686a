"""What the inference service tests start from: principals of the world's tenants, a model,
a service body, and a service created through the services."""

from __future__ import annotations

from apps.core.principals import Principal, PrincipalKind
from apps.inference import services
from apps.inference.models import Model
from apps.tenants.choices import Role
from apps.tenants.models import Tenant

OPERATOR = Principal(PrincipalKind.OPERATOR)


def member(world, slug: str = "acme", role: Role = Role.MEMBER) -> Principal:
    """A member of the tenant, with the tenant as the database has it now (its quota)."""
    tenant = Tenant.objects.get(pk=world.tenants[slug].pk)
    return Principal(PrincipalKind.TENANT_USER, user=world.users[f"{slug}-{role}"], tenant=tenant, role=role)


def set_quota(world, slug: str = "acme", **quota) -> None:
    Tenant.objects.filter(pk=world.tenants[slug].pk).update(**quota)


def make_model(tenant, name: str = "qwen3-8b") -> Model:
    return Model.objects.create(
        tenant=tenant, name=name, source_kind="path", source=f"/models/{name}", format="safetensors"
    )


def body(**fields) -> dict:
    return {
        "name": "chat",
        "model": "qwen3-8b",
        "gpu_type": "nvidia",
        "gpus_per_replica": 2,
        "min_replicas": 2,
        "max_replicas": 4,
        "engine_args": ["--max-model-len", "4096"],
        **fields,
    }


def make_service(world, slug: str = "acme", **fields):
    tenant = world.tenants[slug]
    if not Model.objects.filter(tenant=tenant, name=fields.get("model", "qwen3-8b")).exists():
        make_model(tenant, fields.get("model", "qwen3-8b"))
    return services.create_service(member(world, slug), body(**fields))
