"""What a node says it holds of models, read from its own reports: the model files the
agent's scanner found on disk (`discovered_models`, with the models its running inference
containers serve merged in) and the cache label the agent writes,
`heteroflow.cache/models`. One reading for the node page and for the model registry's
"cached on" join (apps.inference.selectors), so the two cannot disagree.

The label's value is a comma-separated list of model names or paths; a JSON array of
strings is read too. Blank entries are dropped."""

from __future__ import annotations

import json

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
