"""Task jobs: the live logs' retention and their per-task bound (apps.tasks.logs)."""

from __future__ import annotations

from celery import shared_task

from apps.core.guard import periodic_job
from apps.tasks import logs

# makes the coming days' partitions and drops those past HETEROFLOW_TASK_LOG_RETENTION_DAYS
prune_logs_job = periodic_job("tasks.prune_logs", every=600)(logs.prune_and_prepare_partitions)


@shared_task(name="tasks.trim_logs")
def trim_logs_job(task_id: int) -> bool:
    """Asked for by the log ingestion when a task's stored lines pass its bound by a quarter."""
    return logs.trim(task_id)
