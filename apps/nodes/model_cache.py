"""What a node says it holds of models, read from its own reports: the model files the
agent's scanner found on disk (`discovered_models`, with the models its running inference
containers serve merged in) and the cache label the agent writes,
`heteroflow.cache/models`. One reading for the node page and for the model registry's
"cached on" join (apps.inference.selectors), so the two cannot disagree.

The label's value is a comma-separated list of model names or paths; a JSON array of
strings is read too. Blank entries are dropped."""

from __future__ import annotations

import json

from django.db.models import Q
from django.db.models.fields.json import KeyTextTransform

from apps.inference.choices import SourceKind

CACHED_MODELS_LABEL = "heteroflow.cache/models"


def label_models(labels: dict | None) -> list[str]:
    """The entries of the cache label, in order, without blanks or repeats."""
    value = (labels or {}).get(CACHED_MODELS_LABEL)
    if not isinstance(value, str) or not value.strip():
        return []
    entries: list = []
    text = value.strip()
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if isinstance(parsed, list):
            entries = [item for item in parsed if isinstance(item, str)]
    if not entries:
        entries = text.split(",")
    seen: dict[str, None] = {}
    for entry in entries:
        entry = entry.strip()
        if entry:
            seen.setdefault(entry, None)
    return list(seen)


def discovered(node) -> list[dict]:
    """The node's discovered models as dicts with name, path, size_bytes, format and, for
    one an engine of the node has loaded, the task serving it (`task_id`, None
    otherwise); an entry that is not an object is skipped."""
    return [
        {
            "name": str(m.get("name", "")),
            "path": str(m.get("path", "")),
            "size_bytes": m.get("size_bytes"),
            "format": str(m.get("format", "")),
            "task_id": m.get("task_id") if m.get("served") is True and isinstance(m.get("task_id"), int) else None,
        }
        for m in node.discovered_models or []
        if isinstance(m, dict)
    ]


def node_models(node) -> list[dict]:
    """Everything the node holds: its discovered models, then the label's entries that
    name none of them (with no path, size or format)."""
    found = discovered(node)
    known = {m["name"] for m in found} | {m["path"] for m in found if m["path"]}
    found.extend(
        {"name": entry, "path": "", "size_bytes": None, "format": "", "task_id": None}
        for entry in label_models(node.labels)
        if entry not in known
    )
    return found


# --- whether a node holds a model ----------------------------------------------------------
# The one rule of the registry's "cached on" (apps.inference.selectors) and the
# scheduler's model-cache score (apps.scheduler.snapshot): a node holds a model when its
# own reports name it, a discovered model of its name or at its source path (a `path`
# model; trailing slashes ignored), or a cache label entry of its name or its source (the
# path of a `path` model, the hub id of a `hub` model). `model` is anything with `name`,
# `source_kind` and `source`. Which nodes a tenant's model may count is the caller's.


def normal_path(path: str) -> str:
    return path.rstrip("/") or path


def label_keys(model) -> set[str]:
    """What a cache label entry may say for `model`: its name, its path or hub id."""
    keys = {model.name}
    if model.source_kind == SourceKind.PATH:
        keys.add(normal_path(model.source))
    elif model.source_kind == SourceKind.HUB:
        keys.add(model.source)
    return keys


def found_on(model, node) -> tuple[list[dict], bool]:
    """The node's discovered models that are `model`, and whether its cache label names it."""
    path = normal_path(model.source) if model.source_kind == SourceKind.PATH else None
    matches = [m for m in discovered(node) if m["name"] == model.name or (path and normal_path(m["path"]) == path)]
    keys = label_keys(model)
    labelled = any(normal_path(entry) in keys or entry in keys for entry in label_models(node.labels))
    return matches, labelled


def may_hold(nodes, models):
    """`nodes` (a queryset of nodes) narrowed in SQL to a superset of those that hold one of
    `models`: the exact rule is `found_on`, in Python, on these few rows."""
    wanted = Q()
    for model in models:
        wanted |= Q(discovered_models__contains=[{"name": model.name}])
        if model.source_kind == SourceKind.PATH:  # a substring: trailing slashes differ
            wanted |= Q(discovered_models__icontains=normal_path(model.source))
        for key in label_keys(model):
            wanted |= Q(cache_label__contains=key)
    return nodes.annotate(cache_label=KeyTextTransform(CACHED_MODELS_LABEL, "labels")).filter(wanted)
