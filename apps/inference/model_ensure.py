"""What a node's agent tells about making a replica's model present before its engine
starts (the agent's model cache, agent/heteroflow_agent/model_cache; docs/inference.md,
"Model ensure"): one report per state.

- `fetching`: the download's figures (bytes done and total, speed, time left). Kept in
  the cache, not the database: they change every two seconds and matter only while the
  download runs. Each lives PROGRESS_SECONDS after its report, so a line whose agent
  went silent fades from the service page on its own.
- `ready`: the download ended; its line goes and the service's history gets a
  `model_fetched` decision (a model already on the node is not reported: no row per
  replica start).
- `failed`: the model cannot be made present (a missing path, a checksum mismatch, no
  room under the node's cache budget…); its line goes and the history gets an
  `ensure_failed` decision with the agent's reason. The replica's failure itself
  arrives as its report, as any start failure does.
"""

from __future__ import annotations

from django.core.cache import cache
from django.db import transaction

from apps.inference.models import InferenceService, ServiceDecision
from apps.inference.services import record_decision
from apps.tasks.models import Task

SOURCE = "ensure"  # ServiceDecision.source
FETCHING, READY, FAILED = "fetching", "ready", "failed"
STATES = (FETCHING, READY, FAILED)
PROGRESS_SECONDS = 30  # a line outlives its report by this much (the agent reports every 2 s)
PROGRESS_FIELDS = ("model", "bytes_done", "bytes_total", "bytes_per_second", "eta_seconds")


def progress_key(task_id: int) -> str:
    return f"inference:ensure:{task_id}"


def progress_of(task_ids) -> dict[int, dict]:
    """task id -> its replica's download figures, for those downloading now (one read)."""
    keys = {progress_key(task_id): task_id for task_id in task_ids}
    found = cache.get_many(list(keys)) if keys else {}
    return {keys[key]: value for key, value in found.items()}


def report(task: Task, node_id: str, state: str, fields: dict) -> ServiceDecision | None:
    """Apply one report about `task`'s model (a replica of a service, on `node_id`).
    Returns the decision written, if any."""
    service = InferenceService.objects.filter(pk=task.group_id).first() if task.group_id else None
    model = fields.get("model") or (task.serving or {}).get("model") or ""
    if state == FETCHING:
        figures = {name: fields.get(name) for name in PROGRESS_FIELDS} | {"model": model, "node_id": node_id}
        cache.set(progress_key(task.pk), figures, PROGRESS_SECONDS)
        return None
    cache.delete(progress_key(task.pk))
    if service is None:
        return None
    where = f"replica {task.rank} (task {task.pk}) on node {node_id}"
    with transaction.atomic():
        if state == READY:
            done, seconds = fields.get("bytes_done") or 0, fields.get("seconds")
            took = f" in {seconds:g} s" if seconds is not None else ""
            return record_decision(
                service,
                SOURCE,
                "model_fetched",
                f"model {model} fetched for {where}: {done} bytes{took}",
                details={"task_id": task.pk, "node_id": node_id, "model": model, "bytes": done, "seconds": seconds},
            )
        return record_decision(
            service,
            SOURCE,
            "ensure_failed",
            f"{where} could not get its model: {fields.get('message') or 'no reason given'}",
            details={"task_id": task.pk, "node_id": node_id, "model": model},
        )
