"""The one way a service asks for a job: by the job's name, once its transaction commits.

Services never import jobs (docs/architecture.md, "Layers"): a job module sits above the
services it calls, so a service that needs one (a new task wants a scheduler cycle now, a
notification wants delivering) names it instead. The name is looked up in the Celery
app's registry when `enqueue` is called, so a misspelt name fails in the caller, and the
registered task is sent with `apply_async`, so the app's settings (an eager mode
included) apply as they would to `.delay()`.

A broker that is away is logged, not raised: every job asked for here has a periodic
job or a sweep that catches up (the scheduler's 5 s tick, the notification dispatcher's
requeue of overdue deliveries, the next prune request).
"""

from __future__ import annotations

import functools
import logging

from celery import current_app
from django.db import transaction
from django.utils.module_loading import autodiscover_modules

logger = logging.getLogger(__name__)


def enqueue(task_name: str, *args, countdown: float | None = None, **kwargs) -> None:
    """Send the job `task_name` with these arguments after the current transaction
    commits (at once outside a transaction; never, if it rolls back). `countdown`:
    seconds the job waits in the queue before it runs."""
    task = registered_task(task_name)
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(lambda: _send(task, args, kwargs, countdown))
    else:  # not on_commit, which would open a database connection just to learn this
        _send(task, args, kwargs, countdown)


def _send(task, args, kwargs, countdown) -> None:
    try:
        task.apply_async(args=args, kwargs=kwargs, countdown=countdown)
    except Exception:  # the broker is down: the periodic job behind this one catches up
        logger.warning("could not queue the job %s", task.name, exc_info=True)


def registered_task(task_name: str):
    """The Celery task registered under `task_name` (KeyError: no job has that name)."""
    if task_name not in current_app.tasks:
        import_job_modules()
    return current_app.tasks[task_name]


@functools.cache
def import_job_modules() -> None:
    """Import every installed app's `jobs` module, which registers its Celery tasks and
    its periodic jobs. A worker and beat import them at start; a web process only when
    it first asks for a job or reads the periodic declarations."""
    autodiscover_modules("jobs")
