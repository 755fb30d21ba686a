"""Reads of the model registry shared by the API and the portal.

Where a model is cached is joined, not stored: a node caches a model when its own reports
name it (apps.nodes.model_cache reads them):
- a discovered model (`discovered_models`, the agent's disk scan and what its running
  inference containers serve) whose name is the model's name, or whose path is the
  model's source path (a `path` model; trailing slashes ignored);
- an entry of the node's `heteroflow.cache/models` label that is the model's name or its
  source (the path of a `path` model, the hub id of a `hub` model).
Only nodes the model's tenant may use count (shared ones and its dedicated ones): a
node dedicated to another tenant is never shown, whoever asks."""

from __future__ import annotations

from django.db.models import Q
from django.db.models.fields.json import KeyTextTransform

from apps.inference.choices import SourceKind
from apps.inference.models import Model
from apps.nodes.model_cache import CACHED_MODELS_LABEL, discovered, label_models
from apps.nodes.models import Node


def model_list(models, *, format: str = "", engine: str = ""):
    """Models filtered in SQL: by format, and by an engine among those that can serve them."""
    if format:
        models = models.filter(format=format)
    if engine:
        models = models.filter(engines__contains=[engine])
    return models.select_related("tenant").prefetch_related("nodes")


def normal_path(path: str) -> str:
    return path.rstrip("/") or path


def label_keys(model: Model) -> set[str]:
    """What a cache label entry may say for `model`: its name, its path or hub id."""
    keys = {model.name}
    if model.source_kind == SourceKind.PATH:
        keys.add(normal_path(model.source))
    elif model.source_kind == SourceKind.HUB:
        keys.add(model.source)
    return keys


def how_cached(model: Model, node) -> dict | None:
    """How `node` holds `model` (the rule above): the paths its scan found it at, whether
    the label lists it, and the inference tasks whose engine has it loaded (the agent
    marks those entries `served`); None when it does not hold it."""
    path = normal_path(model.source) if model.source_kind == SourceKind.PATH else None
    matches = [m for m in discovered(node) if m["name"] == model.name or (path and normal_path(m["path"]) == path)]
    keys = label_keys(model)
    labelled = any(normal_path(entry) in keys or entry in keys for entry in label_models(node.labels))
    if not matches and not labelled:
        return None
    return {
        "node_id": node.pk,
        "node_name": node.name,
        "status": node.status,
        "paths": sorted({m["path"] for m in matches if m["path"]}),
        "labelled": labelled,
        "served_by_tasks": sorted({m["task_id"] for m in matches if m["task_id"] is not None}),
    }


def candidates(models: list[Model]) -> Q:
    """A superset, in SQL, of the nodes that may cache one of `models`: the exact rule is
    how_cached, in Python, on these few rows."""
    wanted = Q()
    for model in models:
        wanted |= Q(discovered_models__contains=[{"name": model.name}])
        if model.source_kind == SourceKind.PATH:  # a substring: trailing slashes differ
            wanted |= Q(discovered_models__icontains=normal_path(model.source))
        for key in label_keys(model):
            wanted |= Q(cache_label__contains=key)
    return wanted


def cached_on(models) -> dict[int, list[dict]]:
    """model id -> the nodes that cache it (how_cached's dicts, by node name). One query
    for the nodes, whatever the number of models."""
    models = list(models)
    found: dict[int, list[dict]] = {model.pk: [] for model in models}
    if not models:
        return found
    tenants = {model.tenant_id for model in models}
    nodes = (
        Node.objects.filter(Q(tenant__isnull=True) | Q(tenant__in=tenants))
        .annotate(cache_label=KeyTextTransform(CACHED_MODELS_LABEL, "labels"))
        .filter(candidates(models))
        .only("id", "name", "status", "tenant_id", "discovered_models", "labels")
        .order_by("name", "id")
    )
    for node in nodes:
        for model in models:
            if node.tenant_id not in (None, model.tenant_id):
                continue
            held = how_cached(model, node)
            if held:
                found[model.pk].append(held)
    return found


def registered_on(node) -> list[Model]:
    """The models registered (pinned) on `node`, of every tenant, by tenant and name."""
    return list(Model.objects.filter(nodes=node).select_related("tenant").order_by("tenant__slug", "name", "id"))
