"""Every change to the model registry, and the node deletion with its two pre-checks
(active tasks, then the models registered on the node)."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import IntegrityError, transaction
from rest_framework.exceptions import ValidationError

from apps.core.errors import Conflict
from apps.inference.models import Model
from apps.inference.selectors import registered_on
from apps.nodes import services as node_services
from apps.nodes.models import Node
from apps.tenants import policy


def pinned_nodes(tenant, node_ids: list[str]) -> list[Node]:
    """The nodes a model is registered on, each one the tenant may use (shared, or its
    own dedicated node); any other id is unknown (400 on `nodes`), so another tenant's
    node does not reveal that it exists."""
    nodes = {node.pk: node for node in Node.objects.usable_by(tenant.pk).filter(pk__in=node_ids)}
    unknown = [node_id for node_id in node_ids if node_id not in nodes]
    if unknown:
        raise ValidationError({"nodes": [f"No node '{node_id}'." for node_id in unknown]})
    return [nodes[node_id] for node_id in node_ids]


UNIQUE_NAME = "inference_model_tenant_name_unique"


def node_gone() -> ValidationError:
    return ValidationError({"nodes": ["A node was deleted meanwhile; reload and try again."]})


def exists_conflict(tenant, name: str) -> Conflict:
    return Conflict(f"Tenant '{tenant.slug}' already has a model named '{name}'.", "model_exists")


def constraint(exc: IntegrityError) -> str:
    diag = getattr(exc.__cause__, "diag", None)
    return getattr(diag, "constraint_name", "") or ""


def register_model(principal, validated: dict) -> Model:
    """A model from ModelCreateSerializer's validated data, for the tenant the request acts
    for. Raises ValidationError (400), PermissionDenied (403), Http404 (a tenant not the
    caller's) and Conflict (409, the name is taken); nothing is written when it raises."""
    data = dict(validated)
    tenant = policy.acting_tenant(
        principal, data.pop("tenant", None), required="Required: the slug of the tenant the model belongs to."
    )
    policy.check_may_manage_models(principal, tenant)
    nodes = pinned_nodes(tenant, data.pop("nodes", []))
    if Model.objects.filter(tenant=tenant, name=data["name"]).exists():
        raise exists_conflict(tenant, data["name"])
    try:
        with transaction.atomic():
            model = Model.objects.create(tenant=tenant, **data)
            model.nodes.set(nodes)
    except IntegrityError as exc:  # the same name registered at the same moment, or a node deleted
        if constraint(exc) == UNIQUE_NAME:
            raise exists_conflict(tenant, data["name"]) from None
        raise node_gone() from None
    return model


def update_model(principal, model: Model, changes: dict) -> Model:
    """Change a model's size, engines or nodes (ModelUpdateSerializer's validated data;
    a field left out is unchanged). Its name, source and format are what clients and
    replicas rely on: a new model is registered instead."""
    policy.check_may_manage_models(principal, model.tenant)
    changes = dict(changes)
    nodes = pinned_nodes(model.tenant, changes.pop("nodes")) if "nodes" in changes else None
    try:
        with transaction.atomic():
            locked = Model.objects.select_for_update().get(pk=model.pk)
            for field, value in changes.items():
                setattr(locked, field, value)
            locked.save()
            if nodes is not None:
                locked.nodes.set(nodes)
    except IntegrityError:  # a node deleted between the check and the write
        raise node_gone() from None
    return locked


def delete_model(principal, model: Model) -> None:
    policy.check_may_manage_models(principal, model.tenant)
    Model.objects.filter(pk=model.pk).delete()


# --- deleting a node ---------------------------------------------------------------------


@dataclass(frozen=True)
class NodeDeleted:
    node_id: str
    deleted_models: list[str]  # registered on this node only: deleted with it
    unregistered_models: list[str]  # registered elsewhere too: they stay, without this node
    other_tenants_models: int  # of those, how many the caller may not see (counted, not named)


def named(models: list[Model], principal) -> tuple[list[str], int]:
    """`tenant/name` of the models the principal may see (None: everyone's, the admin's
    operators), and how many others there are."""
    if principal is None or principal.is_operator:
        shown = models
    else:
        shown = [model for model in models if principal.is_tenant and model.tenant_id == principal.tenant.pk]
    return [f"{model.tenant.slug}/{model.name}" for model in shown], len(models) - len(shown)


def delete_node(node: Node, *, force: bool = False, principal=None) -> NodeDeleted:
    """Delete a node after two pre-checks, in one transaction with the deletion:
    1. active tasks on it: 409, and force does not apply (apps.nodes.services);
    2. models registered on it: 409 naming them, unless `force`; with force, a model
       registered on this node only is deleted, one registered elsewhere too loses this
       node, and the answer says which.
    `principal` decides which models are named (another tenant's are only counted); None
    names all (the operators' admin)."""
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        node_services.check_no_active_tasks(locked)
        models = registered_on(locked)
        if models and not force:
            shown, hidden = named(models, principal)
            listed = ", ".join(shown[:50]) + (f" and {hidden} of other tenants" if hidden else "")
            raise Conflict(
                f"Node '{node.pk}' has models registered on it: {listed}. "
                "Delete with force to remove those registrations (a model registered on this node only is deleted).",
                "node_has_models",
            )
        only_here = [model for model in models if model.nodes.count() == 1]
        elsewhere = [model for model in models if model not in only_here]
        Model.objects.filter(pk__in=[model.pk for model in only_here]).delete()
        locked.registered_models.clear()  # the registrations of the models that stay
        node_services.delete_node(locked)
    deleted, hidden_deleted = named(only_here, principal)
    unregistered, hidden_unregistered = named(elsewhere, principal)
    return NodeDeleted(node.pk, deleted, unregistered, hidden_deleted + hidden_unregistered)
